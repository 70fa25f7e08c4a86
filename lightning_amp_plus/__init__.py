"""lightning-amp-plus: visible, controllable and safe mixed precision for PyTorch Lightning."""

from lightning_amp_plus.__about__ import __version__
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.precision import AmpPlusPrecision, SkipEvent
from lightning_amp_plus.scaler import DynamicLossScaler

__all__ = [
    "AmpPlusPrecision",
    "DynamicLossScaler",
    "ScaleHistory",
    "SkipEvent",
    "__version__",
]
