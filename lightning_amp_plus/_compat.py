"""0.2's public names that 0.3 replaced, kept for one minor release.

Each warns (``DeprecationWarning``) with its replacement, and works as it did:

* ``plugin.skip_listeners`` / ``plugin.before_unscale_listeners`` (lists of callables): an
  :class:`~lightning_amp_plus.UpdateListener` given to ``plugin.listen(...)``;
* ``plugin.sync_skips = True``: a listener whose ``needs_host_skips`` is True;
* ``DynamicLossScaler.any_step_skipped()``: ``any_skipped(scaler.outcomes(), sync=True)`` (or the plugin's
  ``optimizer_step_was_skipped``); ``has_stepped()`` stays, not deprecated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus.listener import SkipEvent, UpdateListener

if TYPE_CHECKING:
    from lightning_amp_plus.engine import AmpEngine


def deprecated(old: str, new: str) -> None:
    """Warn that ``old`` (0.2's) is deprecated, at the user's line, naming ``new``."""
    warnings.warn(f"`{old}` is deprecated since 0.3 and goes in 0.4: use {new}.", DeprecationWarning, stacklevel=3)


class LegacyScaler:
    """Mixin for :class:`~lightning_amp_plus.DynamicLossScaler`: 0.2's cycle queries."""

    def has_stepped(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` stepped (or skipped) in this cycle, i.e. since the last ``update``."""
        scaler = cast(Any, self)
        key = id(resolve_optimizer(optimizer))
        if not scaler._enabled or key not in scaler._per_optimizer_states:
            return False
        return bool(scaler._per_optimizer_states[key]["stage"] is OptState.STEPPED)

    def any_step_skipped(self) -> bool:
        """Deprecated (0.2): whether any optimizer's last step was skipped (reads a fused step's device flag)."""
        from lightning_amp_plus.scaler import any_skipped  # the scaler module imports this one

        deprecated(
            "DynamicLossScaler.any_step_skipped()",
            "`any_skipped(scaler.outcomes(), sync=True)` (or the plugin's `optimizer_step_was_skipped`)",
        )
        return bool(any_skipped(cast(Any, self).outcomes(), sync=True))


class LegacyListeners(UpdateListener):
    """0.2's callables lists, told as one listener; the plugin forgets it at its teardown, as 0.2 cleared the lists."""

    def __init__(self) -> None:
        self.skip: list[Callable[[SkipEvent], None]] = []
        self.unscale: list[Callable[[Optimizer, int], None]] = []
        self.needs_host_skips = False

    def before_unscale(self, optimizer: Optimizer, step: int) -> None:
        for listener in list(self.unscale):
            listener(optimizer, step)

    def update_skipped(self, event: SkipEvent) -> None:
        for listener in list(self.skip):
            listener(event)


def legacy_listeners(engine: AmpEngine) -> LegacyListeners:
    """The engine's one :class:`LegacyListeners` of this fit, made on first use."""
    for listener in engine.listeners:
        if isinstance(listener, LegacyListeners):
            return listener
    made = LegacyListeners()
    engine.listen(made)
    return made


class LegacyView:
    """Mixin for :class:`~lightning_amp_plus.engine.EngineView`: 0.2's listener lists and ``sync_skips``."""

    _engine: AmpEngine

    @property
    def skip_listeners(self) -> list[Callable[[SkipEvent], None]]:
        """Deprecated: callables ``(event)`` run on each skipped update the host knows (0.2)."""
        deprecated("plugin.skip_listeners", "plugin.listen(listener), a listener overriding `update_skipped(event)`")
        return legacy_listeners(self._engine).skip

    @property
    def before_unscale_listeners(self) -> list[Callable[[Optimizer, int], None]]:
        """Deprecated: callables ``(optimizer, step)`` run just before an optimizer's gradients are unscaled (0.2)."""
        deprecated(
            "plugin.before_unscale_listeners",
            "plugin.listen(listener), a listener overriding `before_unscale(optimizer, step)`",
        )
        return legacy_listeners(self._engine).unscale

    @property
    def sync_skips(self) -> bool:
        """Deprecated: whether a fused optimizer's skip is read on the host at each step (one sync a step)."""
        deprecated("plugin.sync_skips", "a listener with `needs_host_skips = True` (the read follows who listens)")
        return bool(self._engine.sync_skips)

    @sync_skips.setter
    def sync_skips(self, value: Any) -> None:
        deprecated("plugin.sync_skips", "a listener with `needs_host_skips = True` (the read follows who listens)")
        legacy_listeners(self._engine).needs_host_skips = bool(value)
        self._engine.listen(legacy_listeners(self._engine))  # routed again: the read follows
