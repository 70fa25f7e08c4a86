"""The opt-in reruns of a batch's ``training_step``, sandboxed: the float32 reference, and where in backward.

``GradUnderflowMonitor(exact=True)`` compares the run's scaled float16 gradients with the batch's float32 ones
(:func:`float32_gradients`): an element whose true gradient is zero is structural (an embedding row the batch did not
use); one whose true gradient is not zero while the float16 one is zero or subnormal was lost to float16.
``NaNSkipReporter(backward_origin=True)`` reruns a skipped batch whose forward and loss were finite at the skip's scale
and watches its backward node by node (:func:`backward_origin`): the first op whose gradient came out non-finite from
a finite one, the module it ran in, and whether float32 makes it too; and a batch whose inf/nan were born in the
LightningModule's own code between module calls (which no replay reads) in float32 (:func:`told_by_rerun`).

Both run the user's ``training_step`` a second time, which is why they are off unless asked for by name: inside
:func:`~lightning_amp_plus.sandbox.sandboxed` every parameter and buffer is a stand-in and every random stream is given
back, but what the step does outside the model (a file written, an environment stepped, a logger called directly) the
sandbox cannot undo.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_amp_plus._identity import clean_name
from lightning_amp_plus._limits import MAX_ISLANDS
from lightning_amp_plus._log import say
from lightning_amp_plus._tree import tensors
from lightning_amp_plus.callbacks._common import all_reduce_, distributed
from lightning_amp_plus.islands import fp32_forward
from lightning_amp_plus.origin import OWN_CODE, Origin, Phase, Verdict
from lightning_amp_plus.origins import BatchCalls, nonfinite_kinds
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


def announce(who: str, when: str) -> None:
    """Say, as the fit starts, that ``who`` runs the batch's ``training_step`` again, and what it must not do."""
    say(
        f"`{who}`: {when} the batch's `training_step` runs again, in a sandbox (parameters and buffers are stand-ins,"
        " random streams given back). It must not act outside the model: no environment step, file write or direct"
        " logger call."
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
    ranks when several train (as DDP averages ``.grad``); every rank calls this at the same measured steps. The
    last entry is the largest gradient that reached any module's output (the activations' gradients, which a
    scale must fit too, and which can be far larger than the weights').
    """

    def run() -> Optional[list[Optional[Tensor]]]:
        off = torch.autocast(device_type, enabled=False)
        rerun = _rerun(module, state.batch, state.batch_idx, state.start, device_type, off)
        with _activation_gradients(module) as largest, rerun as (loss, box):
            if loss is None:
                return None
            targets = [box.stand_in(p) for p in params]
            grads = list(torch.autograd.grad(loss.float(), targets, allow_unused=True))
            return [*grads, torch.stack(largest).max() if largest else None]

    found, error = attempt(run)
    if error is not None:
        error = f"the float32 reference's `training_step` raised {error}"
    elif found is None:
        error = "the float32 reference's `training_step` returned no loss that requires grad"
    grads = None if found is None else found[:-1]
    activations = None if found is None else found[-1]
    if distributed():  # every rank joins the sum, told or not: a rank without a reference adds zeros
        world = torch.distributed.get_world_size()
        failed = torch.tensor([0.0 if grads is not None else 1.0], device=params[0].device)
        all_reduce_(failed)
        values = grads or [None] * len(params)
        summed = [
            all_reduce_(torch.zeros_like(p) if g is None else g.float()) for p, g in zip(params, values, strict=True)
        ]
        peak = torch.zeros(1, device=params[0].device) if activations is None else activations.reshape(1).clone()
        all_reduce_(peak, op="max")
        if float(failed.item()) > 0:
            return None, error or "the float32 reference failed on another rank"
        return [*(g / world for g in summed), peak.reshape(())], None
    return (None if grads is None else [*grads, activations]), error


@contextlib.contextmanager
def _activation_gradients(module: torch.nn.Module) -> Iterator[list[Tensor]]:
    """The largest gradient that reaches each module's output in the rerun (a list, filled during its backward)."""
    largest: list[Tensor] = []

    def keep(grad: Tensor) -> None:
        largest.append(grad.detach().abs().max().float())

    def watch(mod: torch.nn.Module, args: Any, output: Any) -> None:
        for tensor in tensors(output):
            if tensor.requires_grad and tensor.is_floating_point():
                tensor.register_hook(keep)

    handles = [m.register_forward_hook(watch) for m in module.modules()]
    try:
        yield largest
    finally:
        for handle in handles:
            handle.remove()


def backward_origin(
    module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    start: StepStart,
    device_type: str,
    forward_context: Callable[[], Any],
    scale: float,
) -> Origin:
    """Where in backward a skipped update's inf/nan were born, by rerunning its step twice, sandboxed.

    At the skip's ``scale`` under ``forward_context`` (autocast): the first autograd node whose output gradient was
    non-finite while the gradient it received was finite, named by its op (``SqrtBackward0``) and the module whose
    forward made it (:data:`OWN_CODE`: the LightningModule's own code, the loss say). Then in float32, unscaled:
    ``float32`` finite when every gradient is finite there (float16's range: bf16, an island or a lower scale fixes
    it), non-finite when not (the model's own: no precision fixes it). A rerun that raised or did not make them says
    so in ``reason``.
    """
    found, error = attempt(_watched_backward, module, batch, batch_idx, start, device_type, forward_context, scale)
    if error is not None:
        return Origin(Phase.BACKWARD, reason=f"the rerun of the step raised {error}")
    if found is None:
        return Origin(Phase.BACKWARD, reason="the rerun's backward was finite: it did not make them again")
    return found.but(float32=_finite_as(module, batch, batch_idx, start, device_type))


def told_by_rerun(
    origin: Origin, record: Optional[BatchCalls], trainer: pl.Trainer, device_type: str, scale: Optional[float]
) -> Origin:
    """An origin a replay could not read, told by rerunning the batch's step, sandboxed; else the origin as it was.

    A backward origin: where in backward (:func:`backward_origin`, at the update's ``scale``). A forward origin in
    the LightningModule's own code (:data:`OWN_CODE`, code between module calls no replay reads): its ``float32``
    verdict, the step rerun in float32 (finite: float16 overflowed there; non-finite: the code makes them in any
    precision), and then ``bf16``: the step rerun under bfloat16 autocast (finite: float16's range; non-finite: its
    precision, which bfloat16 has less of; then ``islands``: the modules whose outputs the code took in that, run in
    float32, make the step finite under the run's autocast dtype, measured by rerunning it so; ``()`` when none do).
    Only when the batch's record (and, for backward, the scale) is known.
    """
    start = record.step_start() if record is not None else None
    if record is None or start is None:
        return origin
    module = trainer.lightning_module
    if origin.phase is Phase.FORWARD and origin.own_code and origin.float32 is None:
        told = origin.but(float32=_finite_as(module, record.batch, record.index, start, device_type))
        if told.float32 is Verdict.FINITE:  # float16 fails there: its range (bf16 holds it) or its precision (not)
            bf16 = _finite_as(module, record.batch, record.index, start, device_type, torch.bfloat16)
            told = told.but(bf16=bf16)
            if bf16 is not Verdict.FINITE:
                half = torch.bfloat16 if trainer.precision_plugin.precision == "bf16-mixed" else torch.float16
                islands = _feeding_islands(module, record, start, device_type, half)
                told = told.but(islands=tuple(islands or ()))
        return told
    if origin != Origin(Phase.BACKWARD) or scale is None:
        return origin
    context = trainer.precision_plugin.forward_context
    return backward_origin(module, record.batch, record.index, start, device_type, context, scale)


#: modules tried one at a time as the island that makes an own-code precision loss finite (each a rerun)
_ISLAND_TRIES = 6


def _feeding_islands(
    module: pl.LightningModule, record: BatchCalls, start: StepStart, device_type: str, half: torch.dtype
) -> Optional[list[str]]:
    """The islands that make the step finite under the run's ``half`` autocast, measured by rerunning it so; or None.

    Tried: each module called before the own code took in inf/nan, the latest first (at most ``_ISLAND_TRIES``), then
    the latest ``MAX_ISLANDS`` together: each try is a rerun of the step, on skipped updates only.
    """
    first = next((i for i, c in enumerate(record.calls) if nonfinite_kinds((c.args, c.kwargs), masks="inputs")), None)
    feeding: dict[str, torch.nn.Module] = {}
    for name, called, *_ in record.calls[:first]:
        feeding.setdefault(name, called)
    names = list(feeding)
    tries = [[n] for n in reversed(names[-_ISLAND_TRIES:])] + ([names[-MAX_ISLANDS:]] if len(names) > 1 else [])
    for islands in tries:
        chosen = [feeding[n] for n in islands]
        if _finite_as(module, record.batch, record.index, start, device_type, half, chosen) is Verdict.FINITE:
            return islands
    return None


@contextlib.contextmanager
def _rerun(
    module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    start: StepStart,
    device_type: str,
    forward: Any,
    islands: Sequence[torch.nn.Module] = (),
) -> Iterator[tuple[Optional[Tensor], Any]]:
    """The batch's ``training_step`` rerun in a sandbox, its forward under ``forward`` (a context: autocast or not).

    Yields its loss (None: it returned none that requires grad) and the sandbox's box; ``islands`` run in float32
    meanwhile (as ``fp32_modules`` would). Backward, the caller's, runs outside ``forward``, as Lightning runs it.
    """
    wrapped = [m for m in islands if "forward" not in vars(m)]
    with sandboxed(module, device_type, start=start, grad=True) as box, no_logging(module), torch.enable_grad():
        for m in wrapped:  # put back by the sandbox, with every attribute
            m.forward = fp32_forward(m.forward, device_type)  # type: ignore[method-assign]
        with forward:
            output = module.training_step(copied_inputs(batch), batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
        yield (loss if isinstance(loss, Tensor) and loss.requires_grad else None), box


def _finite_as(
    module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    start: StepStart,
    device_type: str,
    dtype: Optional[torch.dtype] = None,
    islands: Sequence[torch.nn.Module] = (),
) -> Verdict:
    """Are the step's gradients finite rerun in float32 (``dtype`` None) or under ``dtype`` autocast (unknown: raised).

    ``islands`` run in float32 meanwhile (as ``fp32_modules`` would).
    """

    def run() -> Optional[bool]:
        forward = torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)
        with _rerun(module, batch, batch_idx, start, device_type, forward, islands) as (loss, _):
            if loss is None:
                return None
            grads = torch.autograd.grad(loss.float(), _params(module), allow_unused=True)
            return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)

    finite, error = attempt(run)
    if error is not None or finite is None:
        return Verdict.UNKNOWN
    return Verdict.FINITE if finite else Verdict.NONFINITE


def _watched_backward(
    module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    start: StepStart,
    device_type: str,
    forward_context: Callable[[], Any],
    scale: float,
) -> Optional[Origin]:
    context = forward_context()
    with _node_owners(module) as owners, _rerun(module, batch, batch_idx, start, device_type, context) as (loss, _):
        if loss is None:
            return None
        scaled = loss.float() * scale
        born: list[Origin] = []
        handles = [node.register_hook(_first_born(node, owners, born)) for node in _graph([scaled.grad_fn])]
        try:
            torch.autograd.grad(scaled, _params(module), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return born[0] if born else None


def _params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that require grad (inside a sandbox: the stand-ins)."""
    return [p for p in module.parameters() if p.requires_grad]


def _graph(starts: list[Any], stops: Any = ()) -> list[Any]:
    """Every autograd node from ``starts`` back, but the leaves' accumulators and what lies behind ``stops``."""
    seen: dict[Any, None] = {}
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stops or hasattr(node, "variable"):
            continue
        seen[node] = None
        stack.extend(following for following, _ in node.next_functions)
    return list(seen)


def _first_born(node: Any, owners: dict[Any, str], born: list[Origin]) -> Callable[..., None]:
    def hook(grad_inputs: tuple[Optional[Tensor], ...], grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        if born:
            return
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grad_outputs):
            return  # it received them non-finite: made before it
        made = [g for g in grad_inputs if g is not None and not bool(torch.isfinite(g).all())]
        if made:
            kind = "nan" if any(bool(torch.isnan(g).any()) for g in made) else "inf"
            born.append(Origin(Phase.BACKWARD, owners.get(node, OWN_CODE), kind, op=node.name()))

    return hook


@contextlib.contextmanager
def _node_owners(module: torch.nn.Module) -> Iterator[dict[Any, str]]:
    """Each autograd node the rerun makes, with the module whose own forward made it (inner modules first)."""
    owners: dict[Any, str] = {}
    names = {id(m): clean_name(n) for n, m in module.named_modules() if n}

    def own(mod: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(mod))
        if name is None:
            return
        stops = {t.grad_fn for t in tensors(args) if t.grad_fn is not None}
        # through a child's nodes too (`return self.o(h)`): the nodes between are this module's own
        for node in _graph([t.grad_fn for t in tensors(output)], stops):
            owners.setdefault(node, name)  # an inner module's forward ran first: it keeps its own nodes

    handles = [m.register_forward_hook(own) for m in module.modules()]
    try:
        yield owners
    finally:
        for handle in handles:
            handle.remove()
