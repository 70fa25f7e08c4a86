"""A listener to the engine's updates made of plain functions (what a test wants to hear)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from lightning_amp_plus.engine import UpdateListener


def listener(
    before_unscale: Optional[Callable[..., Any]] = None,
    skipped_step: Optional[Callable[..., Any]] = None,
    update_skipped: Optional[Callable[..., Any]] = None,
    needs_host_skips: bool = False,
) -> UpdateListener:
    """An `UpdateListener` whose hooks call the functions given (only those are overridden: only those are called)."""
    hooks: dict[str, Any] = {"needs_host_skips": needs_host_skips}
    for name, function in (
        ("before_unscale", before_unscale),
        ("skipped_step", skipped_step),
        ("update_skipped", update_skipped),
    ):
        if function is not None:
            hooks[name] = staticmethod(function)
    return type("Heard", (UpdateListener,), hooks)()
