"""lightning-amp-plus: visible, controllable and safe mixed precision for PyTorch Lightning.

The public names load on first use (PEP 562), so ``import lightning_amp_plus`` and the command line
(``lightning-amp-plus --version``, ``--help``) do not import torch or Lightning until a name needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_amp_plus.__about__ import __version__

#: public name -> the module that defines it
_EXPORTS = {
    "Advice": "lightning_amp_plus.advice",
    "AmpAdvisor": "lightning_amp_plus.callbacks",
    "AmpEngine": "lightning_amp_plus.engine",
    "AmpPlusFSDPPrecision": "lightning_amp_plus.fsdp",
    "AmpPlusFabricPrecision": "lightning_amp_plus.fabric",
    "AmpPlusPrecision": "lightning_amp_plus.precision",
    "AmpPlusWarning": "lightning_amp_plus._warnings",
    "DynamicLossScaler": "lightning_amp_plus.scaler",
    "GradUnderflowMonitor": "lightning_amp_plus.callbacks",
    "LossScaleCollapseError": "lightning_amp_plus.callbacks",
    "LossScaleMonitor": "lightning_amp_plus.callbacks",
    "NaNSkipReporter": "lightning_amp_plus.callbacks",
    "NonFiniteChecker": "lightning_amp_plus.scaler",
    "PrecisionReport": "lightning_amp_plus.callbacks",
    "ScaleHistory": "lightning_amp_plus.history",
    "ShardedDynamicLossScaler": "lightning_amp_plus.scaler",
    "SkipEvent": "lightning_amp_plus.listener",
    "UpdateCycle": "lightning_amp_plus.engine",
    "UpdateListener": "lightning_amp_plus.listener",
    "plot_history": "lightning_amp_plus.plot",
    "plot_run": "lightning_amp_plus.plot",
}

__all__ = [
    "Advice",
    "AmpAdvisor",
    "AmpEngine",
    "AmpPlusFSDPPrecision",
    "AmpPlusFabricPrecision",
    "AmpPlusPrecision",
    "AmpPlusWarning",
    "DynamicLossScaler",
    "GradUnderflowMonitor",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "NaNSkipReporter",
    "NonFiniteChecker",
    "PrecisionReport",
    "ScaleHistory",
    "ShardedDynamicLossScaler",
    "SkipEvent",
    "UpdateCycle",
    "UpdateListener",
    "__version__",
    "plot_history",
    "plot_run",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_amp_plus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from lightning_amp_plus._warnings import AmpPlusWarning
    from lightning_amp_plus.advice import Advice
    from lightning_amp_plus.callbacks import (
        AmpAdvisor,
        GradUnderflowMonitor,
        LossScaleCollapseError,
        LossScaleMonitor,
        NaNSkipReporter,
        PrecisionReport,
    )
    from lightning_amp_plus.engine import AmpEngine, SkipEvent, UpdateCycle
    from lightning_amp_plus.fabric import AmpPlusFabricPrecision
    from lightning_amp_plus.fsdp import AmpPlusFSDPPrecision
    from lightning_amp_plus.history import ScaleHistory
    from lightning_amp_plus.plot import plot_history, plot_run
    from lightning_amp_plus.precision import AmpPlusPrecision
    from lightning_amp_plus.scaler import DynamicLossScaler, NonFiniteChecker, ShardedDynamicLossScaler
