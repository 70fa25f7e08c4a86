"""Callbacks that read the AmpPlusPrecision plugin: one per file."""

from lightning_amp_plus.callbacks.advisor import AmpAdvisor
from lightning_amp_plus.callbacks.grad_underflow_monitor import GradUnderflowMonitor
from lightning_amp_plus.callbacks.loss_scale_monitor import LossScaleMonitor
from lightning_amp_plus.callbacks.nan_skip_reporter import LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.callbacks.precision_report import PrecisionReport

__all__ = [
    "AmpAdvisor",
    "GradUnderflowMonitor",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "NaNSkipReporter",
    "PrecisionReport",
]
