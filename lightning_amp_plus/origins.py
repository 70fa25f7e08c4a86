"""0.3's path of :class:`OriginFinder`: it lives in :mod:`lightning_amp_plus.forensics.finder` now (goes in 0.5)."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {"OriginFinder": "lightning_amp_plus.forensics.finder"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"`lightning_amp_plus.origins.{name}` moved to `{_MOVED[name]}.{name}`; the old path goes in 0.5.",
        DeprecationWarning,
        stacklevel=2,
    )
    import importlib

    return getattr(importlib.import_module(_MOVED[name]), name)
