"""0.3's path of the sandbox: it lives in :mod:`lightning_amp_plus.forensics.sandbox` now (goes in 0.5).

``sandboxed`` takes ``(modules, device_type, start=None)`` there: the replayed modules, not what they reach.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("sandboxed", "attempt")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"`lightning_amp_plus.sandbox.{name}` moved to `lightning_amp_plus.forensics.sandbox.{name}`; the old path"
        " goes in 0.5.",
        DeprecationWarning,
        stacklevel=2,
    )
    from lightning_amp_plus.forensics import sandbox

    return getattr(sandbox, name)
