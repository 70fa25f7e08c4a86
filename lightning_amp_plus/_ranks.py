"""Ranks: whether several train, and a reduction every rank joins (torch only)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["all_reduce_", "distributed"]


def distributed() -> bool:
    """Whether a process group with more than one rank is up."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )


def all_reduce_(tensor: Tensor, op: str = "sum") -> Tensor:
    """Reduce ``tensor`` over every rank in place (a no-op in one process); every rank must call it."""
    if distributed():
        reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
        torch.distributed.all_reduce(tensor, op=reduce_op)
    return tensor
