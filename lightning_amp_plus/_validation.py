"""Shared argument checks and their messages.

Every public constructor validates its arguments here, so one message exists per rule and each is pinned by a test.
Messages name the call, the argument, the value given and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_real(owner: str, name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ``TypeError`` if it is not a real number (bools are refused)."""
    if not _is_real(value):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected a real number, got {type(value).__name__}.")
    return float(value)


def check_int(owner: str, name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``; raise ``TypeError``/``ValueError`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected an int, got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{owner}({name}={value!r})` is invalid: expected an int >= {minimum}.")
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected a bool, got {type(value).__name__}.")
    return value


def check_choice(owner: str, name: str, value: Any, allowed: Iterable[Any], hint: str = "") -> Any:
    """Return ``value`` if it is one of ``allowed``; raise ``ValueError`` naming the choices otherwise."""
    allowed = tuple(allowed)
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        message = f"`{owner}({name}={value!r})` is invalid: expected one of {choices}."
        if hint:
            message += f" HINT: {hint}"
        raise ValueError(message)
    return value


def check_scaler_args(
    owner: str,
    *,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any,
    max_scale: Any,
    hysteresis: Any,
) -> None:
    """Validate the knobs of a dynamic loss scaler (shared by the scaler and the Lightning plugin)."""
    init_scale = check_real(owner, "init_scale", init_scale)
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"`{owner}(init_scale={init_scale!r})` is invalid: expected a finite number > 0.")
    growth_factor = check_real(owner, "growth_factor", growth_factor)
    if not (math.isfinite(growth_factor) and growth_factor > 1):
        raise ValueError(
            f"`{owner}(growth_factor={growth_factor!r})` is invalid: expected a finite number > 1"
            " (the scale is multiplied by it after `growth_interval` clean steps)."
        )
    backoff_factor = check_real(owner, "backoff_factor", backoff_factor)
    if not 0 < backoff_factor < 1:
        raise ValueError(
            f"`{owner}(backoff_factor={backoff_factor!r})` is invalid: expected 0 < backoff_factor < 1"
            " (the scale is multiplied by it when a step overflows)."
        )
    check_int(owner, "growth_interval", growth_interval, minimum=1)
    check_int(owner, "hysteresis", hysteresis, minimum=1)
    min_scale = check_real(owner, "min_scale", min_scale)
    if not (math.isfinite(min_scale) and min_scale >= 0):
        raise ValueError(f"`{owner}(min_scale={min_scale!r})` is invalid: expected a finite number >= 0.")
    max_scale = check_real(owner, "max_scale", max_scale)
    if math.isnan(max_scale) or max_scale <= 0:
        raise ValueError(f"`{owner}(max_scale={max_scale!r})` is invalid: expected a number > 0 (inf allowed).")
    if min_scale > max_scale:
        raise ValueError(
            f"`{owner}(min_scale={min_scale!r}, max_scale={max_scale!r})` is invalid: expected min_scale <= max_scale."
        )
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(
            f"`{owner}(init_scale={init_scale!r})` is invalid: expected min_scale <= init_scale <= max_scale"
            f" ({min_scale!r} <= init_scale <= {max_scale!r}). HINT: widen `min_scale`/`max_scale` or change"
            " `init_scale`."
        )
