"""HostSyncCounter: count host-device synchronisations (``.item()``, ``bool(tensor)``, ...) in a block of code."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncCounter(TorchDispatchMode):
    """Count ``aten._local_scalar_dense`` dispatches: every tensor-to-Python-scalar read, the host syncs of AMP.

    Deterministic on any device, so a test can assert a sync budget. It sees the ops of the thread it runs in.

    Example:
        >>> import torch
        >>> from lightning_amp_plus.syncs import HostSyncCounter
        >>> with HostSyncCounter() as counter:
        ...     x = torch.ones(3).sum()
        ...     y = float(x)
        >>> counter.count
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
