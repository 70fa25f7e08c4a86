"""The float32 reference of a measured update (opt-in): the batch's ``training_step`` run again, sandboxed, in float32.

``GradUnderflowMonitor(exact=True)`` compares the run's scaled float16 gradients with these: an element whose true
gradient is zero is structural (an embedding row the batch did not use); one whose true gradient is not zero while the
float16 one is zero or subnormal was lost to float16. It runs the user's ``training_step`` a second time, which is why
it is off unless asked for by name: inside :func:`~lightning_amp_plus.sandbox.sandboxed` every parameter and buffer
is a stand-in and every random stream is given back, but what the step does outside the model (a file written, an
environment stepped, a logger called directly) the sandbox cannot undo.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_amp_plus.callbacks._common import all_reduce_, distributed
from lightning_amp_plus.sandbox import StepStart, attempt, capture, copied_inputs, no_logging, sandboxed


class BatchState:
    """A measured batch kept for its reference: a copy of the batch, its index, and the random state it started with.

    ``owned``: the random streams the model holds (``reach(module).streams``), recorded with the global ones.
    """

    def __init__(self, batch: Any, batch_idx: int, device_type: str, owned: list[Any]) -> None:
        self.batch = copied_inputs(batch)  # the step may change its batch in place; the reference sees it as it came
        self.batch_idx = batch_idx
        cuda = device_type == "cuda" and torch.cuda.is_available()
        numpy = sys.modules.get("numpy")
        host = [random._inst, *([numpy.random.mtrand._rand] if numpy is not None else [])]  # type: ignore[attr-defined]
        self.start = StepStart(
            torch.default_generator.get_state(),
            torch.cuda.default_generators[torch.cuda.current_device()].get_state() if cuda else None,
            owned=capture(owned),
            host=capture(host),
        )


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
) -> tuple[Optional[list[Optional[Tensor]]], Optional[str]]:
    """``params``' gradients of the batch's loss recomputed in float32, or None and why not.

    Same random state as the batch had (dropout masks alike), no logging, in a sandbox: the run's parameters,
    buffers, random streams and ``.grad`` are untouched, and what the step raises is returned as text. Averaged over
    ranks when several train (as DDP averages ``.grad``); every rank calls this at the same measured steps.
    """

    def run() -> Optional[list[Optional[Tensor]]]:
        with (
            sandboxed(module, device_type, start=state.start, grad=True) as box,
            no_logging(module),
            torch.autocast(device_type, enabled=False),
            torch.enable_grad(),
        ):
            output = module.training_step(state.batch, state.batch_idx)
            loss = output.get("loss") if isinstance(output, dict) else output
            if not isinstance(loss, Tensor) or not loss.requires_grad:
                return None
            targets = [box.stand_in(p) for p in params]
            return list(torch.autograd.grad(loss.float(), targets, allow_unused=True))

    grads, error = attempt(run)
    if error is not None:
        error = f"the float32 reference's `training_step` raised {error}"
    elif grads is None:
        error = "the float32 reference's `training_step` returned no loss that requires grad"
    if distributed():  # every rank joins the sum, told or not: a rank without a reference adds zeros
        world = torch.distributed.get_world_size()
        failed = torch.tensor([0.0 if grads is not None else 1.0], device=params[0].device)
        all_reduce_(failed)
        values = grads or [None] * len(params)
        summed = [
            all_reduce_(torch.zeros_like(p) if g is None else g.float()) for p, g in zip(params, values, strict=True)
        ]
        if float(failed.item()) > 0:
            return None, error or "the float32 reference failed on another rank"
        return [g / world for g in summed], None
    return grads, error
