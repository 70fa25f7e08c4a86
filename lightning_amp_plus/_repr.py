"""``__repr__`` for the plugins and callbacks: the class and the arguments that differ from the defaults."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any


def given_arguments(function: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``arguments`` (a constructor's ``locals()``) that differ from ``function``'s defaults."""
    given = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if (
            name == "self"
            or name not in arguments
            or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
        ):
            continue
        value = _python(arguments[name])
        if parameter.default is inspect.Parameter.empty or not same_value(value, parameter.default):
            given[name] = value
    return given


def _python(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (a repr, a logged call, a fix line then read as Python)."""
    if isinstance(value, numbers.Number) and type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared differ
        return False


class KnobsRepr:
    """Mixin: ``ClassName(arg=value, ...)`` with the arguments given to the constructor that differ from defaults."""

    _given: dict[str, Any]

    def __repr__(self) -> str:
        given = getattr(self, "_given", {})
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in given.items())})"


def number(value: float) -> str:
    """A scale as a line shows it, exactly: a whole number in full (``4194304``, not ``4.1943e+06``)."""
    value = float(value)
    if not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.0f}" if value.is_integer() else repr(value)  # exact either way (2**-20: 9.5367431640625e-07)
