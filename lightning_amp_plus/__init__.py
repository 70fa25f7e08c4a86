"""lightning-amp-plus: visible, controllable and safe mixed precision for PyTorch Lightning."""

from lightning_amp_plus.__about__ import __version__
from lightning_amp_plus._warnings import AmpPlusWarning
from lightning_amp_plus.callbacks import (
    GradUnderflowMonitor,
    LossScaleCollapseError,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from lightning_amp_plus.engine import AmpEngine, SkipEvent
from lightning_amp_plus.fabric import AmpPlusFabricPrecision
from lightning_amp_plus.fsdp import AmpPlusFSDPPrecision
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.plot import plot_history, plot_run
from lightning_amp_plus.precision import AmpPlusPrecision
from lightning_amp_plus.scaler import DynamicLossScaler, ShardedDynamicLossScaler

__all__ = [
    "AmpEngine",
    "AmpPlusWarning",
    "AmpPlusFSDPPrecision",
    "AmpPlusFabricPrecision",
    "AmpPlusPrecision",
    "DynamicLossScaler",
    "GradUnderflowMonitor",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "NaNSkipReporter",
    "PrecisionReport",
    "ScaleHistory",
    "ShardedDynamicLossScaler",
    "SkipEvent",
    "__version__",
    "plot_history",
    "plot_run",
]
