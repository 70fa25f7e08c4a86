"""Reruns of a batch's ``training_step`` (opt-in by name): the float32 reference, and what no watch reads.

``GradUnderflowMonitor(exact=True)`` compares the run's float16 gradients with the batch's float32 ones
(:func:`float32_gradients`). ``NaNSkipReporter(backward_origin=True)`` reruns a skipped batch for where in backward
its inf/nan were born, and for an own-code origin's verdicts and islands (:func:`origin_by_rerun`). Both run your step
again, in :func:`~.sandbox.sandboxed`: parameters, buffers and random streams are put back; anything else the step
does (a file written, an environment stepped) happens again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_amp_plus._limits import GRAPH_NODES, MAX_ISLANDS
from lightning_amp_plus._log import say
from lightning_amp_plus._ranks import all_reduce_, distributed
from lightning_amp_plus.forensics._modules import walk
from lightning_amp_plus.forensics._safe import attempt
from lightning_amp_plus.forensics._tree import tensors
from lightning_amp_plus.forensics.observe import BatchRecord
from lightning_amp_plus.forensics.opt_in.sandbox import copied_inputs, no_logging, sandboxed
from lightning_amp_plus.forensics.origin import OWN_CODE, Origin, Phase, Verdict
from lightning_amp_plus.islands import in_float32

#: modules tried one at a time as the island that makes an own-code precision loss finite (each a rerun)
_ISLAND_TRIES = 6


def announce(who: str, when: str) -> None:
    """Say, as the fit starts, that ``who`` runs the batch's ``training_step`` again, and what it must not do."""
    say(
        f"`{who}`: {when} the batch's `training_step` runs again, in a sandbox: parameters, buffers and random streams"
        " are put back; anything else it does (a file written, an environment stepped, a logger called) happens again."
    )


def why_no_reference(trainer: pl.Trainer, sharded: bool) -> Optional[str]:
    """Why this run's updates cannot be recomputed from one batch (None: they can)."""
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization (the training step steps the optimizers itself)"
    if trainer.accumulate_grad_batches > 1:
        return "gradient accumulation (an update spans several batches)"
    return "a sharded model (every rank holds a shard)" if sharded else None


def float32_gradients(
    module: pl.LightningModule, record: BatchRecord, params: list[torch.nn.Parameter], device_type: str
) -> tuple[Optional[list[Optional[Tensor]]], Optional[str]]:
    """``params``' gradients of ``record``'s batch recomputed in float32 (from its random state), or None and why not.

    Averaged over ranks when several train (as DDP averages ``.grad``: every rank calls this at the same steps). The
    last entry is the largest gradient that reached any module's output (the activations', which a scale must fit
    too, and which can be far larger than the weights').
    """
    largest: list[Tensor] = []

    def keep(mod: torch.nn.Module, args: Any, output: Any) -> None:
        for tensor in tensors(output):
            if tensor.requires_grad and tensor.is_floating_point():
                tensor.register_hook(lambda grad: largest.append(grad.detach().abs().max().float()))

    off = torch.autocast(device_type, enabled=False)
    grads, error = attempt(_gradients, module, record, device_type, off, (), params, keep)
    if error is not None or grads is None:
        told = f"raised {error}" if error is not None else "returned no loss that requires grad"
        grads, error = None, f"the float32 reference's `training_step` {told}"
    peak = torch.stack(largest).max() if largest and grads is not None else None
    if not distributed():
        return (None if grads is None else [*grads, peak]), error
    # every rank joins the sums, told or not: a rank without a reference adds zeros
    failed = all_reduce_(torch.tensor([0.0 if grads is not None else 1.0], device=params[0].device))
    given = grads or [None] * len(params)
    summed = [all_reduce_(torch.zeros_like(p) if g is None else g.float()) for p, g in zip(params, given, strict=True)]
    peak = all_reduce_(torch.zeros(1, device=params[0].device) if peak is None else peak.reshape(1).clone(), op="max")
    if float(failed.item()) > 0:
        return None, error or "the float32 reference failed on another rank"
    world = torch.distributed.get_world_size()
    return [*(g / world for g in summed), peak.reshape(())], None


def origin_by_rerun(
    origin: Origin,
    record: Optional[BatchRecord],
    trainer: pl.Trainer,
    device_type: str,
    scale: Optional[float],
    before: Sequence[str] = (),
) -> Origin:
    """An origin a replay could not read, told by rerunning the batch's step, sandboxed; else the origin as it was.

    Backward (at the update's ``scale``): the first autograd node whose output gradient came out non-finite from a
    finite one, by op (``SqrtBackward0``) and the module whose forward made it, and ``float32``: the gradients
    rerun in float32. The own code: ``float32``, then ``bf16`` (finite: float16's range; not: its precision), then
    the ``islands`` among ``before`` (the modules the step called before) that make the step finite under the run's
    own autocast dtype (``()``: none). ``reason``: a rerun raised or did not make them again.
    """
    if record is None or record.start is None:
        return origin
    module = trainer.lightning_module
    if origin.phase is Phase.FORWARD and origin.own_code and origin.float32 is None:
        told = origin.replace(float32=_finite_as(module, record, device_type))
        if told.float32 is Verdict.FINITE:  # float16 fails there: its range (bf16 holds it) or its precision (not)
            told = told.replace(bf16=_finite_as(module, record, device_type, torch.bfloat16))
            if told.bf16 is not Verdict.FINITE:
                half = torch.bfloat16 if trainer.precision_plugin.precision == "bf16-mixed" else torch.float16
                told = told.replace(islands=tuple(_feeding_islands(module, record, device_type, half, before)))
        return told
    if origin.phase is not Phase.BACKWARD or origin.op is not None or origin.float32 is not None or scale is None:
        return origin
    owners: dict[Any, str] = {}
    born: list[Origin] = []

    def watch_graph(loss: Tensor) -> list[Any]:
        return [node.register_hook(_first_born(node, owners, born)) for node in _graph([loss.grad_fn])]

    context = trainer.precision_plugin.forward_context()
    watch = _owner(module, owners)
    _, error = attempt(lambda: _gradients(module, record, device_type, context, (), None, watch, scale, watch_graph))
    if error is not None:
        return Origin(Phase.BACKWARD, reason=f"the rerun of the step raised {error}")
    if not born:
        return Origin(Phase.BACKWARD, reason="the rerun's backward was finite: it did not make them again")
    return born[0].replace(float32=_finite_as(module, record, device_type))


def _feeding_islands(
    module: pl.LightningModule, record: BatchRecord, device_type: str, half: torch.dtype, before: Sequence[str]
) -> list[str]:
    """The islands that make the step finite under the run's ``half`` autocast, measured by rerunning it so.

    Tried: each of ``before``, the latest first (at most ``_ISLAND_TRIES``), then the latest ``MAX_ISLANDS``
    together: each try is a rerun of the step, on skipped updates only.
    """
    modules = {seen.name: seen.module for seen in walk(module)}  # a compiled one: its inner module, named alike
    feeding = {n: modules[n] for n in before if n in modules}
    names = list(feeding)
    tries = [[n] for n in reversed(names[-_ISLAND_TRIES:])] + ([names[-MAX_ISLANDS:]] if len(names) > 1 else [])
    for islands in tries:
        if _finite_as(module, record, device_type, half, [feeding[n] for n in islands]) is Verdict.FINITE:
            return islands
    return []


def _finite_as(
    module: pl.LightningModule,
    record: BatchRecord,
    device_type: str,
    dtype: Optional[torch.dtype] = None,
    islands: Sequence[torch.nn.Module] = (),
) -> Verdict:
    """Whether the step's gradients are finite rerun under ``dtype`` autocast (None: float32), ``islands`` in float32.

    Unknown: it raised, or made no loss.
    """
    forward = torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)
    grads, error = attempt(_gradients, module, record, device_type, forward, islands)
    if error is not None or grads is None:
        return Verdict.UNKNOWN
    return Verdict.FINITE if all(bool(torch.isfinite(g).all()) for g in grads if g is not None) else Verdict.NONFINITE


def _gradients(
    module: pl.LightningModule,
    record: BatchRecord,
    device_type: str,
    forward: Any,
    islands: Sequence[torch.nn.Module] = (),
    params: Optional[list[torch.nn.Parameter]] = None,
    watch: Optional[Callable[[torch.nn.Module, Any, Any], None]] = None,
    scale: float = 1.0,
    before: Optional[Callable[[Tensor], list[Any]]] = None,
) -> Optional[list[Optional[Tensor]]]:
    """``params``' (default: every trained one's) gradients of ``record``'s step rerun, sandboxed; None: no loss.

    Its forward under ``forward`` (autocast or not), ``islands`` in float32 (as ``fp32_modules``), ``watch`` a forward
    hook on every module, the loss times ``scale``; ``before(loss)`` hooks the graph. Hooks are removed after.
    """
    loaded = record.loaded if record.loaded is not None else record.batch
    if record.loaded is None and record.changed():
        raise RuntimeError("the step changed its batch in place: a rerun would not start from the batch as loaded")
    with (
        sandboxed([module], device_type, start=record.start) as box,
        no_logging(module),
        torch.enable_grad(),
        contextlib.ExitStack() as stack,
    ):
        stack.enter_context(in_float32(islands, device_type))
        if watch is not None:
            stack.callback(_removed, [m.register_forward_hook(watch) for m in module.modules()])
        with forward:
            output = module.training_step(copied_inputs(loaded), record.index)
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return None
        scaled = loss.float() * scale
        if before is not None:
            stack.callback(_removed, before(scaled))
        targets: list[Tensor] = [p for p in module.parameters() if p.requires_grad]  # inside the sandbox: stand-ins
        targets = [box[id(p)] for p in params] if params is not None else targets
        return list(torch.autograd.grad(scaled, targets, allow_unused=True))


def _removed(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _graph(starts: list[Any], stops: Any = ()) -> list[Any]:
    """Every autograd node from ``starts`` back, but the leaves' accumulators and what lies behind ``stops``."""
    seen: dict[Any, None] = {}
    stack = list(starts)
    while stack and len(seen) < GRAPH_NODES:  # deeper: torch crashes freeing the graph
        node = stack.pop()
        if node is None or node in seen or node in stops or hasattr(node, "variable"):
            continue
        seen[node] = None
        stack.extend(following for following, _ in node.next_functions)
    return list(seen)


def _first_born(node: Any, owners: dict[Any, str], born: list[Origin]) -> Callable[..., None]:
    """A node hook: the first node whose output gradient came out non-finite from a finite one, into ``born``."""

    def hook(grad_inputs: tuple[Optional[Tensor], ...], grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        if born or not all(g is None or bool(torch.isfinite(g).all()) for g in grad_outputs):
            return  # found, or it received them non-finite: made before it
        made = [g for g in grad_inputs if g is not None and not bool(torch.isfinite(g).all())]
        if made:
            kind = "nan" if any(bool(torch.isnan(g).any()) for g in made) else "inf"
            born.append(Origin(Phase.BACKWARD, owners.get(node, OWN_CODE), kind, op=node.name()))

    return hook


def _owner(module: torch.nn.Module, owners: dict[Any, str]) -> Callable[[torch.nn.Module, Any, Any], None]:
    """A forward hook: each autograd node a module's own forward makes, into ``owners`` (inner modules first)."""
    names = {id(seen.module): seen.name for seen in walk(module)}

    def own(mod: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(mod))
        if name is not None:
            stops = {t.grad_fn for t in tensors(args) if t.grad_fn is not None}
            # through a child's nodes too (`return self.o(h)`): the nodes between are this module's own
            for node in _graph([t.grad_fn for t in tensors(output)], stops):
                owners.setdefault(node, name)  # an inner module's forward ran first: it keeps its own nodes

    return own
