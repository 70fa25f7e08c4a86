"""The fix lines: the run's own plugin call with one change, written as paste-able literals."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from lightning_amp_plus import knobs

if TYPE_CHECKING:
    from lightning_amp_plus.advice.registry import RunFigures


def plugin_fix(figures: RunFigures, comment: Optional[str] = None, **change: Any) -> str:
    """The run's own plugin call with ``change`` applied: every other argument the user gave stays as given.

    Example:
        >>> from lightning_amp_plus.advice import RunFigures
        >>> figures = RunFigures(plugin_args={"precision": "16-mixed", "growth_interval": 50})
        >>> plugin_fix(figures, hysteresis=2)
        'AmpPlusPrecision("16-mixed", growth_interval=50, hysteresis=2)'
        >>> plugin_fix(figures, "no scale needed", precision="bf16-mixed")
        'AmpPlusPrecision("bf16-mixed")  # no scale needed'
    """
    args = {**figures.plugin_args, **change}
    precision = args.pop("precision", "16-mixed")
    if precision == "bf16-mixed":
        args = {k: v for k, v in args.items() if k not in knobs.NAMES}  # bf16-mixed refuses them
    parts = [f'"{precision}"', *(f"{k}={_literal(v)}" for k, v in args.items())]
    line = f"{figures.plugin}({', '.join(parts)})"
    return f"{line}  # {comment}" if comment else line


def _given_islands(figures: RunFigures) -> list[str]:
    """The islands the user gave the plugin: a fix keeps them."""
    return list(figures.plugin_args.get("fp32_modules") or [])


def _literal(value: Any) -> str:
    """A paste-able literal: powers of two as ``2.0**k``, strings in double quotes, lists of those."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return f'float("{value}")'  # inf: no bound (a literal `inf` is no Python)
        exponent = math.log2(value) if value > 0 else 0.5
        return _scale(value) if exponent == int(exponent) else repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _scale(value: float) -> str:
    """``2.0**16`` for powers of two (paste-able, exact), else the number."""
    if not math.isfinite(value):
        return f'float("{value}")'
    if value > 0:
        exponent = math.log2(value)
        if exponent == int(exponent):
            return f"2.0**{int(exponent)}"
    return f"{value:g}"
