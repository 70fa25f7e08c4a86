"""0.2's public names that 0.3 replaced, kept for one minor release (by composition: no base class of ours).

Each warns (``DeprecationWarning``) with its replacement, and works as it did:

* ``plugin.skip_listeners`` / ``plugin.before_unscale_listeners`` (lists of callables): an
  :class:`~lightning_amp_plus.UpdateListener` given to ``plugin.listen(...)``;
* ``plugin.sync_skips = True``: a listener whose ``needs_host_skips`` is True;
* ``DynamicLossScaler.any_step_skipped()`` (defined on the scaler): ``any_skipped(scaler.outcomes(), sync=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from lightning_amp_plus._warnings import deprecated
from lightning_amp_plus.listener import SkipEvent, UpdateListener


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


def legacy_listeners(engine: Any) -> LegacyListeners:
    """The engine's one :class:`LegacyListeners` of this fit, made (and listened to) on first use."""
    for listener in engine.listeners:
        if isinstance(listener, LegacyListeners):
            return listener
    made = LegacyListeners()
    engine.listen(made)
    return made


class Deprecated:
    """A plugin attribute of 0.2 (``plugin.<name>``): it warns with ``new`` and reads (or sets) the listener's field.

    ``field``: the :class:`LegacyListeners` attribute it stands for (``skip``, ``unscale``, ``needs_host_skips``).
    """

    def __init__(self, field: str, new: str, doc: str) -> None:
        self.field, self.new, self.__doc__ = field, new, doc
        self.name = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, plugin: Any, owner: Any = None) -> Any:
        if plugin is None:
            return self
        deprecated(f"plugin.{self.name}", self.new)
        if self.field == "needs_host_skips":  # 0.2's sync_skips read whether anyone needs the read
            return bool(plugin.engine.sync_skips)
        return getattr(legacy_listeners(plugin.engine), self.field)

    def __set__(self, plugin: Any, value: Any) -> None:
        if self.field != "needs_host_skips":
            raise AttributeError(f"`plugin.{self.name}` cannot be set; append to it (0.2) or use {self.new}.")
        deprecated(f"plugin.{self.name}", self.new)
        listeners = legacy_listeners(plugin.engine)
        listeners.needs_host_skips = bool(value)
        plugin.engine.listen(listeners)  # routed again: the read follows
