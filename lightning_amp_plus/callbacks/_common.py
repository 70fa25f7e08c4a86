"""What the callbacks share: finding the plugin, logging to every logger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_amp_plus.precision import AmpPlusPrecision


def find_plugin(trainer: pl.Trainer, owner: str) -> AmpPlusPrecision:
    """The trainer's :class:`AmpPlusPrecision`, or a ``ValueError`` that says how to add it."""
    plugin = trainer.strategy.precision_plugin
    if not isinstance(plugin, AmpPlusPrecision):
        raise ValueError(
            f"`{owner}` needs the `AmpPlusPrecision` plugin, but the trainer uses {type(plugin).__name__}."
            " HINT: `Trainer(plugins=[AmpPlusPrecision('16-mixed')])` (and no `precision=` flag)."
        )
    return plugin


def log_to_all(trainer: pl.Trainer, metrics: dict[str, Any], step: int) -> None:
    """Log ``metrics`` at ``step`` to every logger of the trainer, from rank zero only."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
