"""The loss scaler's knobs, declared once: name, default, kind, where the scaler keeps it, and what is allowed.

Standard library only (the ``advise`` command reads it without torch). Everything that lists the knobs reads
:data:`KNOBS`: the scaler (its constructor, :meth:`reset`, ``state_dict`` keys, ``load_state_dict``), the plugins'
signatures (``init_scale: float = DEFAULTS["init_scale"]``: the value shows in ``help()``, IDEs and
``--print_config``), the argument checks (:func:`check_knobs`, one message per rule), and the advice's fix lines
(a bf16 fix drops :data:`NAMES`). Adding a knob is a row here, the scaler's use of it, and its line in the docs.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeGuard

from lightning_amp_plus._limits import FLOAT32_MAX, FLOAT32_TINY, INT32_MAX


def is_real(value: Any) -> TypeGuard[float]:
    """A real number (an int, a float, a NumPy scalar), not a bool: the one test every real-number check uses."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> TypeGuard[int]:
    """An integer (an int, a NumPy integer), not a bool: the one test every integer check uses."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def type_name(value: Any) -> str:
    """The type an error message names: ``bool``, or ``numpy.bool`` (a NumPy bool is no ``bool``: said so)."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__.partition('.')[0]}.{cls.__qualname__}"


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as the device-side scale and its update see it."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def float32_scale(value: float) -> bool:
    """Whether ``value`` is a finite, normal, positive float32 whose inverse is finite too."""
    return math.isfinite(value) and FLOAT32_TINY <= value <= FLOAT32_MAX


_SPAN = f"[{FLOAT32_TINY!r}, {FLOAT32_MAX!r}]"


@dataclass(frozen=True)
class Knob:
    """One knob: its name, default and kind, the scaler attribute that holds it, and its rule.

    ``allowed(value)`` returns None when the value is allowed, else what is (the message's "expected ..."). ``torch``:
    ``torch.amp.GradScaler`` has it too (its attribute and its ``state_dict`` key are torch's).
    """

    name: str
    default: Any
    integer: bool
    attribute: str
    torch: bool
    allowed: Callable[[Any], Optional[str]]

    def convert(self, value: Any) -> Any:
        """The value as the scaler keeps it (a float, or an int; an int beyond float's range: inf)."""
        if self.integer:
            return int(value)
        try:
            return float(value)
        except OverflowError:  # an int such as 10**400
            return math.inf if value > 0 else -math.inf


def _scale(value: float) -> Optional[str]:
    if float32_scale(value):
        return None
    return f"expected a finite float32 scale in {_SPAN} (2**-126 to float32's max), whose inverse float32 can hold too."


def _growth_factor(value: float) -> Optional[str]:
    if not (math.isfinite(value) and 1 < value <= FLOAT32_MAX):
        return (
            "expected a finite number > 1 that float32 can hold (the scale is multiplied by it after"
            " `growth_interval` clean steps)."
        )
    if as_float32(value) == 1.0:
        return (
            "float32 rounds it to 1.0, so the scale would never grow; expected a factor float32 tells from 1"
            " (> 1 + 2**-24, e.g. 1.001)."
        )
    return None


def _backoff_factor(value: float) -> Optional[str]:
    if not (FLOAT32_TINY <= value < 1):
        return (
            "expected 0 < backoff_factor < 1, at least 2**-126 so that float32 can hold it (the scale is multiplied"
            " by it when a step overflows)."
        )
    if as_float32(value) == 1.0:
        return (
            "float32 rounds it to 1.0, so the scale would never back off; expected a factor float32 tells from 1"
            " (< 1 - 2**-25, e.g. 0.999)."
        )
    return None


def _count(value: int) -> Optional[str]:
    return None if 1 <= value <= INT32_MAX else f"expected an int in [1, {INT32_MAX}] (the device tracker is int32)."


def _min_scale(value: float) -> Optional[str]:
    return (
        None
        if value == 0 or float32_scale(value)
        else f"expected 0 (no bound but float32's) or a finite float32 scale in {_SPAN}."
    )


def _max_scale(value: float) -> Optional[str]:
    return None if value == math.inf or float32_scale(value) else f"expected inf or a finite float32 scale in {_SPAN}."


#: the knobs, in the order of ``torch.amp.GradScaler``'s arguments, then ours
KNOBS: tuple[Knob, ...] = (
    Knob("init_scale", 2.0**16, False, "_init_scale", True, _scale),
    Knob("growth_factor", 2.0, False, "_growth_factor", True, _growth_factor),
    Knob("backoff_factor", 0.5, False, "_backoff_factor", True, _backoff_factor),
    Knob("growth_interval", 2000, True, "_growth_interval", True, _count),
    Knob("min_scale", 1.0, False, "_min_scale", False, _min_scale),
    Knob("max_scale", 2.0**24, False, "_max_scale", False, _max_scale),
    Knob("hysteresis", 1, True, "_hysteresis", False, _count),
)
#: each knob's default, by name (the plugins' signatures name these values)
DEFAULTS: dict[str, Any] = {knob.name: knob.default for knob in KNOBS}
#: the knobs' names (a bf16 fix line drops them: bf16-mixed has no scaler)
NAMES: tuple[str, ...] = tuple(DEFAULTS)


def knob_values(values: dict[str, Any]) -> dict[str, Any]:
    """A constructor's knobs as the scaler keeps them: None is the default, a real number (NumPy's too) a Python one.

    None was every knob's default in 0.2 (LightningCLI configs saved then hold ``growth_factor: null``): it still
    means the default. A value of the wrong kind is left for :func:`check_knobs` to refuse.
    """
    out = dict(values)
    for knob in KNOBS:
        value = values.get(knob.name, DEFAULTS[knob.name])
        if value is None:
            out[knob.name] = knob.default
        elif is_int(value) if knob.integer else is_real(value):
            out[knob.name] = knob.convert(value)
    return {name: value for name, value in out.items() if name in values}


def check_knobs(owner: str, values: dict[str, Any], label: Optional[dict[str, str]] = None) -> None:
    """Check the knobs in ``values`` (a missing ``init_scale`` is not checked), each by its rule, then together.

    Messages name the call, the argument (``label`` renames one: a checkpoint key), the value and what is allowed:
    ``TypeError`` for the wrong kind, ``ValueError`` for a value outside what is allowed.
    """
    names = label or {}

    def invalid(name: str, value: Any) -> str:
        return f"`{owner}({names.get(name, name)}={value!r})` is invalid"

    for knob in KNOBS:
        if knob.name not in values or (knob.name == "init_scale" and values[knob.name] is None):
            continue  # the knobs given only (a setter, a checkpoint's knobs, a scale); a constructor's None: default
        value = values[knob.name]
        if not (is_int(value) if knob.integer else is_real(value)):
            kind = "an int" if knob.integer else "a real number"
            raise TypeError(f"{invalid(knob.name, value)}: expected {kind}, got {type_name(value)}.")
        value = knob.convert(value)  # a real number is told as the float it becomes
        expected = knob.allowed(value)
        if expected is not None:
            raise ValueError(f"{invalid(knob.name, value)}: {expected}")
    low, high = values.get("min_scale", DEFAULTS["min_scale"]), values.get("max_scale", DEFAULTS["max_scale"])
    if low > high:
        raise ValueError(
            f"`{owner}({names.get('min_scale', 'min_scale')}={low!r}, {names.get('max_scale', 'max_scale')}={high!r})`"
            " is invalid: expected min_scale <= max_scale."
        )
    init = values.get("init_scale")
    if init is not None and not low <= init <= high:  # checked above: a real number
        given = ", ".join(
            f"{names.get(n, n)}={v!r}" for n, v in (("init_scale", init), ("min_scale", low), ("max_scale", high))
        )
        raise ValueError(
            f"`{owner}({given})` is invalid: expected min_scale <= init_scale <= max_scale. HINT: widen"
            " `min_scale`/`max_scale` or change `init_scale`."
        )


def check_new_scale(owner: str, value: Any) -> None:
    """A scale set by hand (``update(new_scale=...)``): a one-element tensor (not read here) or a finite number > 0."""
    if callable(getattr(value, "numel", None)) and hasattr(value, "device"):  # a tensor (a numpy scalar is a number)
        if value.numel() == 1:
            return
    elif is_real(value) and 0 < value < math.inf:
        return
    raise ValueError(
        f"`{owner}(new_scale={value!r})` is invalid: expected a finite scale > 0 or a one-element tensor (it is"
        " brought inside [min_scale, max_scale])."
    )


def grows(tracker: Any, interval: Any, exact: bool) -> Any:
    """Whether a clean update with the growth tracker at ``tracker`` grows the scale (host ints or device tensors).

    The one growth rule: torch's kernel (``hysteresis=1``) grows when ``tracker + 1 == interval`` exactly (a tracker
    left above a lowered interval never grows again, as in torch); the hysteresis rule when it reaches it.

    Example:
        >>> grows(1999, 2000, exact=True), grows(2000, 2000, exact=True), grows(2000, 2000, exact=False)
        (True, False, True)
    """
    return tracker + 1 == interval if exact else tracker + 1 >= interval


#: the keys of a ``torch.amp.GradScaler.state_dict()``
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@dataclass(frozen=True)
class Checkpoint:
    """A scaler checkpoint's values, checked: its knobs, its scale (inside the bounds), its trackers.

    ``changes``: what it changes of the scaler that loads it, said to the user.
    """

    knobs: dict[str, Any]
    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    changes: list[str]


def read_checkpoint(where: str, state: Any, current: dict[str, Any], keep: frozenset[str] = frozenset()) -> Checkpoint:
    """A scaler ``state_dict`` (ours, or a plain ``GradScaler``'s: ``current`` knobs then stay) checked by the rules.

    The knobs named in ``keep`` (those given to the constructor) stay ``current``: a setting passed on resume is meant.
    An invalid value raises ``ValueError``/``TypeError`` naming the checkpoint key and the value.
    """
    if not isinstance(state, dict):
        raise TypeError(f"`{where}` expected a dict (a scaler's `state_dict()`), got {type_name(state)}.")
    missing = [key for key in TORCH_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"`{where}`: the state lacks {', '.join(map(repr, missing))} (it has"
            f" {', '.join(map(repr, state)) or 'no keys'}); expected a `GradScaler.state_dict()`."
        )
    knobs = {name: value if name in keep else state.get(name, value) for name, value in current.items()}
    scale = state["scale"]
    if hasattr(scale, "numel") and scale.numel() == 1:  # a tensor (torch is not imported here)
        scale = scale.item()
    if not is_real(scale):
        raise TypeError(f"`{where}(scale={scale!r})` is invalid: expected a real number, got {type_name(scale)}.")
    check_knobs(where, knobs)
    # a scale float32 can hold, then brought inside the bounds
    check_knobs(where, {"init_scale": scale, "min_scale": 0.0, "max_scale": math.inf}, label={"init_scale": "scale"})
    growth = state["_growth_tracker"]
    if not is_int(growth) or not 0 <= growth <= INT32_MAX:  # above growth_interval: torch writes it too
        raise ValueError(
            f"`{where}(_growth_tracker={growth!r})` is invalid: expected an int in [0, {INT32_MAX}] (the count of"
            " clean steps since the last growth or skip)."
        )
    hysteresis = state.get("_hysteresis_tracker", knobs["hysteresis"])
    if is_int(hysteresis) and "hysteresis" in keep:  # a smaller hysteresis given: its tracker within it
        hysteresis = min(hysteresis, knobs["hysteresis"])
    if not is_int(hysteresis) or not 0 <= hysteresis <= knobs["hysteresis"]:
        raise ValueError(
            f"`{where}(_hysteresis_tracker={hysteresis!r})` is invalid: expected an int in"
            f" [0, hysteresis={knobs['hysteresis']}]."
        )
    bounded = min(max(float(scale), knobs["min_scale"]), knobs["max_scale"])
    changes = [f"{n} {v!r} -> {knobs[n]!r}" for n, v in current.items() if float(v) != float(knobs[n])]
    changes += [
        f"{n}={v!r} kept as given (the checkpoint's: {state[n]!r})"
        for n, v in current.items()
        if n in keep and n in state and is_real(state[n]) and float(state[n]) != float(v)
    ]
    if bounded != scale:
        changes.append(
            f"scale {scale!r} -> {bounded!r} (brought inside [min_scale, max_scale] ="
            f" [{knobs['min_scale']!r}, {knobs['max_scale']!r}])"
        )
    return Checkpoint(knobs, bounded, int(growth), int(hysteresis), changes)
