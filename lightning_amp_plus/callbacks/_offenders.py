"""The parameters whose gradients held inf/nan on a skipped update, with their counts (one host transfer a skip)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_amp_plus._ranks import all_reduce_
from lightning_amp_plus.callbacks._common import local_tensor, parameters_and_names
from lightning_amp_plus.syncs import to_host

Offender = dict[str, Any]  # {"name": ..., "inf": n, "nan": n}


class OffenderCounter:
    """Counts inf/nan per parameter on skipped updates only; clean steps cost nothing.

    A GAN's training step may zero an optimizer's gradients before the update closes, so each optimizer is counted
    right after its step was skipped (:meth:`at_skipped_step`) and :meth:`of` reads those counts. With sharded
    gradients every rank counts its shards of every parameter and the counts are summed over the ranks.
    """

    def __init__(self) -> None:
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._names: dict[int, str] = {}
        self._sharded = False
        self._at_step: dict[int, list[Offender]] = {}  # per optimizer, counted when its step was skipped

    def track(self, module: torch.nn.Module, sharded: bool) -> None:
        """Name the parameters of ``module`` as trained (call it after sharding: FSDP2 replaces them)."""
        self._params, self._names = parameters_and_names(module)
        self._sharded = sharded
        self._at_step = {}

    def clear(self) -> None:
        """Forget the counts kept for the update that closed."""
        self._at_step = {}

    def at_skipped_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s gradients now, while they are the ones its skipped step refused."""
        if not self._sharded:  # sharded: every rank counts its shards of every parameter when the update closes
            self._at_step[id(optimizer)] = self._of_optimizer(optimizer)

    def of(self, optimizers: list[torch.optim.Optimizer]) -> list[Offender]:
        """The offenders of a skipped update whose steps were ``optimizers``'."""
        if self._sharded:
            names = [name for name, _ in self._params]
            grads = [None if param.grad is None else local_tensor(param.grad) for _, param in self._params]
            return self._count(names, grads)
        offenders: list[Offender] = []
        for optimizer in optimizers:  # as counted when its step was skipped, else now
            counted = self._at_step.get(id(optimizer))
            offenders += counted if counted is not None else self._of_optimizer(optimizer)
        return offenders

    def _of_optimizer(self, optimizer: torch.optim.Optimizer) -> list[Offender]:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        names = [self._names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params]
        return self._count(names, [local_tensor(p.grad) for p in params])

    def _count(self, names: list[str], grads: list[Optional[Tensor]]) -> list[Offender]:
        present = [g for g in grads if g is not None]
        if not present and not self._sharded:
            return []
        device = present[0].device if present else torch.device("cpu")
        zero = torch.zeros(2, dtype=torch.int64, device=device)
        packed = torch.stack(
            [zero if g is None else torch.stack([g.isinf().sum(), g.isnan().sum()]).to(device) for g in grads]
        )
        if self._sharded:
            all_reduce_(packed)
        counts = to_host(packed)  # one host transfer, on skipped steps only
        return [
            {"name": name, "inf": int(n_inf), "nan": int(n_nan)}
            for name, (n_inf, n_nan) in zip(names, counts, strict=False)
            if n_inf or n_nan
        ]
