"""Shared argument checks and their messages.

Every public constructor validates its arguments here, so one message exists per rule and each is pinned by a test.
Messages name the call, the argument, the value given and what is allowed.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable
from typing import Any, Optional, TypeGuard

import torch

from lightning_amp_plus._limits import FLOAT32_MAX, FLOAT32_TINY, INT32_MAX


def is_real(value: Any) -> TypeGuard[float]:
    """An int or a float, not a bool: the one test every real-number check uses."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> TypeGuard[int]:
    """An int, not a bool: the one test every integer check uses."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_real(owner: str, name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ``TypeError`` if it is not a real number (bools are refused)."""
    if not is_real(value):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected a real number, got {type(value).__name__}.")
    return float(value)


def check_int(owner: str, name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``; raise ``TypeError``/``ValueError`` otherwise."""
    if not is_int(value):
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


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as the device-side scale and its update see it."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _float32_scale(value: float) -> bool:
    """Whether ``value`` is a finite, normal, positive float32 whose inverse is finite too."""
    return math.isfinite(value) and FLOAT32_TINY <= value <= FLOAT32_MAX


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
    label: Optional[dict[str, str]] = None,
) -> None:
    """Validate the knobs of a dynamic loss scaler (the constructors and ``load_state_dict`` share it).

    Every scale, bound and factor must be something float32 can hold on the device: a finite, normal float32 (and
    for a scale, one whose inverse is finite too); ``max_scale`` may be ``inf``; ``min_scale`` may be 0 (the scale
    then never backs off below float32's smallest normal value, 2**-126). The integer knobs must fit the int32
    device trackers. ``init_scale=None`` checks the other knobs only. ``label`` renames arguments in the
    messages (a checkpoint key instead of the argument).
    """
    names = label or {}

    def call(name: str, value: Any) -> str:
        return f"`{owner}({names.get(name, name)}={value!r})` is invalid"

    def real(name: str, value: Any) -> float:
        if not is_real(value):
            raise TypeError(f"{call(name, value)}: expected a real number, got {type(value).__name__}.")
        return float(value)

    def integer(name: str, value: Any, minimum: int) -> int:
        if not is_int(value):
            raise TypeError(f"{call(name, value)}: expected an int, got {type(value).__name__}.")
        if not minimum <= value <= INT32_MAX:
            raise ValueError(
                f"{call(name, value)}: expected an int in [{minimum}, {INT32_MAX}] (the device tracker is int32)."
            )
        return value

    span = f"[{FLOAT32_TINY!r}, {FLOAT32_MAX!r}]"
    if init_scale is not None:
        init_scale = real("init_scale", init_scale)
    if init_scale is not None and not _float32_scale(init_scale):
        raise ValueError(
            f"{call('init_scale', init_scale)}: expected a finite float32 scale in {span} (2**-126 to float32's max),"
            " whose inverse float32 can hold too."
        )
    growth_factor = real("growth_factor", growth_factor)
    if not (math.isfinite(growth_factor) and 1 < growth_factor <= FLOAT32_MAX):
        raise ValueError(
            f"{call('growth_factor', growth_factor)}: expected a finite number > 1 that float32 can hold"
            " (the scale is multiplied by it after `growth_interval` clean steps)."
        )
    if as_float32(growth_factor) == 1.0:
        raise ValueError(
            f"{call('growth_factor', growth_factor)}: float32 rounds it to 1.0, so the scale would never grow;"
            " expected a factor float32 tells from 1 (> 1 + 2**-24, e.g. 1.001)."
        )
    backoff_factor = real("backoff_factor", backoff_factor)
    if not (FLOAT32_TINY <= backoff_factor < 1):
        raise ValueError(
            f"{call('backoff_factor', backoff_factor)}: expected 0 < backoff_factor < 1, at least 2**-126 so that"
            " float32 can hold it (the scale is multiplied by it when a step overflows)."
        )
    if as_float32(backoff_factor) == 1.0:
        raise ValueError(
            f"{call('backoff_factor', backoff_factor)}: float32 rounds it to 1.0, so the scale would never back"
            " off; expected a factor float32 tells from 1 (< 1 - 2**-25, e.g. 0.999)."
        )
    integer("growth_interval", growth_interval, 1)
    integer("hysteresis", hysteresis, 1)
    min_scale = real("min_scale", min_scale)
    if not (min_scale == 0 or _float32_scale(min_scale)):
        raise ValueError(
            f"{call('min_scale', min_scale)}: expected 0 (no bound but float32's) or a finite float32 scale in {span}."
        )
    max_scale = real("max_scale", max_scale)
    if not (max_scale == math.inf or _float32_scale(max_scale)):
        raise ValueError(f"{call('max_scale', max_scale)}: expected inf or a finite float32 scale in {span}.")
    if min_scale > max_scale:
        raise ValueError(
            f"`{owner}({names.get('min_scale', 'min_scale')}={min_scale!r},"
            f" {names.get('max_scale', 'max_scale')}={max_scale!r})` is invalid: expected min_scale <= max_scale."
        )
    if init_scale is not None and not min_scale <= init_scale <= max_scale:
        given = ", ".join(
            f"{names.get(n, n)}={v!r}"
            for n, v in (("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale))
        )
        raise ValueError(
            f"`{owner}({given})` is invalid: expected min_scale <= init_scale <= max_scale. HINT: widen"
            " `min_scale`/`max_scale` or change `init_scale`."
        )


def check_prefix(owner: str, prefix: Any) -> str:
    """Return a metric-key prefix: a str (``""`` allowed); ``TypeError`` otherwise."""
    if not isinstance(prefix, str):
        raise TypeError(
            f"`{owner}(prefix={prefix!r})` is invalid: expected a str such as 'amp/' (or '' for none),"
            f" got {type(prefix).__name__}."
        )
    return prefix


def check_path(owner: str, name: str, value: Any) -> Any:
    """Return ``value`` if it is ``None`` or a non-empty file path (str or ``os.PathLike``); raise otherwise."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{owner}({name}={value!r})` is invalid: expected a file path (str or os.PathLike) or None,"
            f" got {type(value).__name__}."
        )
    if not os.fspath(value):
        raise ValueError(f"`{owner}({name}={value!r})` is invalid: expected a non-empty file path, or None.")
    return value


def check_fraction(owner: str, name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a real number with ``0 < value <= 1``; raise otherwise."""
    value = check_real(owner, name, value)
    if not 0 < value <= 1:
        raise ValueError(f"`{owner}({name}={value!r})` is invalid: expected 0 < {name} <= 1.")
    return value


def _autocast_available(device: str) -> bool:
    try:
        return bool(torch.amp.autocast_mode.is_autocast_available(device))
    except RuntimeError:  # a device type torch does not know
        return False


def check_device(owner: str, device: Any) -> Optional[str]:
    """Return ``device`` if it is ``None`` or a device type autocast supports (``"cuda"``, ``"cpu"``, ...)."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise TypeError(
            f"`{owner}(device={device!r})` is invalid: expected a device type string such as 'cuda' or 'cpu',"
            " or None for the trainer's accelerator."
        )
    if not _autocast_available(device):
        hint = {"gpu": "use 'cuda'", "auto": "leave `device=None` to follow the trainer's accelerator"}.get(
            device.lower(), f"device types are lower case: {device.lower()!r}" if device != device.lower() else ""
        )
        raise ValueError(
            f"`{owner}(device={device!r})` is invalid: expected a device type that autocast supports, such as"
            f" 'cuda', 'cpu', 'mps', 'xpu' or 'hpu', or None for the trainer's accelerator."
            + (f" HINT: {hint}." if hint else "")
        )
    return device
