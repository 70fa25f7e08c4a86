"""0.3's path of the sandbox: it lives in :mod:`lightning_amp_plus.forensics.opt_in.sandbox` now (goes in 0.5).

``sandboxed`` takes ``(modules, device_type, start=None)`` there: the replayed modules, not what they reach.
``attempt`` lives in :mod:`lightning_amp_plus.forensics._safe` (the default path's).
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {"sandboxed": "forensics.opt_in.sandbox", "attempt": "forensics._safe"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    where = f"lightning_amp_plus.{_MOVED[name]}"
    warnings.warn(
        f"`lightning_amp_plus.sandbox.{name}` moved to `{where}.{name}`; the old path goes in 0.5.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)
