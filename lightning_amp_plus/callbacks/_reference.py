"""The float32 reference of a measured update: the same batch's gradients recomputed without autocast.

``GradUnderflowMonitor`` compares the run's scaled float16 gradients with these: an element whose true gradient is
zero is structural (an embedding row the batch did not use); one whose true gradient is not zero while the float16
one is zero or subnormal was lost to float16.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_amp_plus.callbacks._common import all_reduce_, distributed
from lightning_amp_plus.origins import (
    host_random_state,
    leaves_no_trace,
    no_logging,
    replay_scope,
    set_host_random_state,
    tensor_hooks_kept,
)


class BatchState:
    """A batch kept for its reference: the batch, its index, and the random-number state it started with."""

    def __init__(self, batch: Any, batch_idx: int, device_type: str) -> None:
        self.batch = batch
        self.batch_idx = batch_idx
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if device_type == "cuda" and torch.cuda.is_available() else None
        self.host_rng = host_random_state()  # Python's and numpy's: a step may draw from them too


def why_no_reference(trainer: pl.Trainer, sharded: bool) -> Optional[str]:
    """Why this run's updates cannot be recomputed from one batch (None: they can)."""
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization (the training step steps the optimizers itself)"
    if trainer.accumulate_grad_batches > 1:
        return "gradient accumulation (an update spans several batches)"
    if sharded:
        return "a sharded model (every rank holds a shard)"
    return None


def float32_gradients(
    module: pl.LightningModule, state: BatchState, params: list[torch.nn.Parameter], device_type: str
) -> Optional[list[Optional[Tensor]]]:
    """``params``' gradients of the batch's loss recomputed in float32 (None: the step returned no loss).

    Same random-number state as the batch had (dropout masks alike), no logging, the model left as it was found;
    the gradients go nowhere near ``.grad``. Averaged over ranks when several train (as DDP averages ``.grad``).
    """
    with (
        replay_scope(),
        leaves_no_trace(
            module,
            device_type,
            what="`GradUnderflowMonitor`: the float32 reference's `training_step`",
            hint="`GradUnderflowMonitor(exact=False)` for a step that writes parameters in place (an EMA update)",
        ),
        tensor_hooks_kept(list(module.parameters())),
        no_logging(module),
        torch.autocast(device_type, enabled=False),
        torch.enable_grad(),
    ):
        torch.set_rng_state(state.cpu_rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state(state.cuda_rng)
        set_host_random_state(state.host_rng)
        output = module.training_step(state.batch, state.batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return None
        grads: list[Optional[Tensor]] = list(torch.autograd.grad(loss.float(), params, allow_unused=True))
    if distributed():
        world = torch.distributed.get_world_size()
        summed = [
            all_reduce_(torch.zeros_like(p) if g is None else g.float()) for p, g in zip(params, grads, strict=True)
        ]
        return [g / world for g in summed]
    return grads
