"""Callbacks that read the AmpPlusPrecision plugin: one per file."""

from lightning_amp_plus.callbacks.loss_scale_monitor import LossScaleMonitor
from lightning_amp_plus.callbacks.nan_skip_reporter import LossScaleCollapseError, NaNSkipReporter

__all__ = ["LossScaleCollapseError", "LossScaleMonitor", "NaNSkipReporter"]
