"""Shared argument checks and their messages.

Every public constructor validates its arguments here, so one message exists per rule and each is pinned by a test.
Messages name the call, the argument, the value given and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Optional

import torch

from lightning_amp_plus.knobs import is_int, is_real, type_name

__all__ = ["is_int", "is_real"]  # the one test of each kind, shared with the knob checks


def check_real(owner: str, name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ``TypeError`` if it is not a real number (bools are refused)."""
    if not is_real(value):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected a real number, got {type_name(value)}.")
    return float(value)


def check_int(owner: str, name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``; raise ``TypeError``/``ValueError`` otherwise."""
    if not is_int(value):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected an int, got {type_name(value)}.")
    if value < minimum:
        raise ValueError(f"`{owner}({name}={value!r})` is invalid: expected an int >= {minimum}.")
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})` is invalid: expected a bool, got {type_name(value)}.")
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


def check_prefix(owner: str, prefix: Any) -> str:
    """Return a metric-key prefix: a str (``""`` allowed); ``TypeError`` otherwise."""
    if not isinstance(prefix, str):
        raise TypeError(
            f"`{owner}(prefix={prefix!r})` is invalid: expected a str such as 'amp/' (or '' for none),"
            f" got {type_name(prefix)}."
        )
    return prefix


def check_path(owner: str, name: str, value: Any) -> Any:
    """Return ``value`` if it is ``None`` or a non-empty file path (str or ``os.PathLike``); raise otherwise."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{owner}({name}={value!r})` is invalid: expected a file path (str or os.PathLike) or None,"
            f" got {type_name(value)}."
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
    if ":" in device:  # a device ('cuda:1'), not its type: autocast and the trainer's accelerator take the type
        raise ValueError(
            f"`{owner}(device={device!r})` is invalid: expected a device type such as 'cuda' or 'cpu', not a device"
            f" with an index. HINT: use device={device.split(':')[0]!r} (the trainer's `devices=` picks the index)."
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
