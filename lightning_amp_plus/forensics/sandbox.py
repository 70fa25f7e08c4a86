"""0.4's path of the sandbox: it lives in :mod:`lightning_amp_plus.forensics.opt_in.sandbox` now (goes in 0.6).

``attempt`` and ``torch_own`` (the default path's) live in :mod:`lightning_amp_plus.forensics._safe`.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {"sandboxed": "opt_in.sandbox", "attempt": "_safe", "torch_own": "_safe"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    where = f"lightning_amp_plus.forensics.{_MOVED[name]}"
    warnings.warn(
        f"`lightning_amp_plus.forensics.sandbox.{name}` moved to `{where}.{name}`; the old path goes in 0.6.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)
