"""The package's console lines: the ``lightning_amp_plus`` logger, from rank zero only (torch only).

Skip lines, summaries and what a checkpoint changed are information, not warnings: they go through Python
``logging`` (no file-path prefix, no once-per-location suppression). Misconfigurations stay warnings
(:class:`~lightning_amp_plus.AmpPlusWarning`).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("lightning_amp_plus")


def global_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def say(message: str) -> None:
    """Log ``message`` at WARNING level (shown without any logging set-up) from rank zero only."""
    if global_rank() == 0:
        log.warning(message)
