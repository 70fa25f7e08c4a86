"""Replay (opt-in, ``NaNSkipReporter(find_origin="replay")``): measure a watched origin's float32 verdict and islands.

A :class:`Recorder` keeps each call of the modules the LightningModule calls. On a skip the watch named the module;
:func:`measure` runs its call again, with the later calls that took its output, :func:`~.sandbox.sandboxed` and
watched: as the step ran (it must make them again), then with each module found in float32 until nothing is born.
Your modules' code runs again: what it does beyond parameters, buffers and random streams happens again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_amp_plus._limits import MAX_ISLANDS
from lightning_amp_plus.forensics._modules import call_frontier, walk
from lightning_amp_plus.forensics._safe import attempt, raised, replaying
from lightning_amp_plus.forensics._tree import map_tensors, tensors, version
from lightning_amp_plus.forensics.observe import Watch, nonfinite_kind, read
from lightning_amp_plus.forensics.opt_in.sandbox import States, capture, copied_inputs, give_back, no_logging, sandboxed
from lightning_amp_plus.forensics.origin import Origin, Verdict
from lightning_amp_plus.forensics.verdict import first_born
from lightning_amp_plus.islands import in_float32, island_of


@dataclass
class Call:
    """One recorded call: module, arguments, random state before it, trace position, and its output (held weakly)."""

    name: str
    module: torch.nn.Module
    args: Any
    kwargs: Any
    versions: list[int]
    rng: States
    position: int
    output: list[weakref.ref] = field(default_factory=list)

    def held(self) -> list[Tensor]:
        """The tensors it gave that the step still holds."""
        return [t for t in (ref() for ref in self.output) if t is not None]

    def alive(self) -> Optional[list[Tensor]]:
        """The tensors it gave, or None where the step freed one of them."""
        held = self.held()
        return held if len(held) == len(self.output) else None


class Recorder:
    """Keeps each training batch's calls of the modules ``module`` calls, into the list :attr:`calls` names."""

    def __init__(self, module: torch.nn.Module, watch: Watch, device_type: str) -> None:
        self.calls: Optional[list[Call]] = None
        cuda = device_type == "cuda" and torch.cuda.is_available()
        self._generators = [
            torch.default_generator,
            *([torch.cuda.default_generators[torch.cuda.current_device()]] if cuda else []),
        ]
        self._handles = []
        made = self._made
        for name, called in call_frontier(module):
            if not isinstance(called, torch.jit.ScriptModule):
                self._handles.append(called.register_forward_pre_hook(self._keep(name, watch), with_kwargs=True))
                self._handles.append(called.register_forward_hook(made, with_kwargs=True))

    def _keep(self, name: str, watch: Watch) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if self.calls is not None and not replaying():
                held = [version(t) for t in tensors((args, kwargs))]
                position = len(watch.trace or ())
                self.calls.append(Call(name, module, args, kwargs, held, capture(self._generators), position))

        return keep

    def _made(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.calls and not replaying() and self.calls[-1].module is module and not self.calls[-1].output:
            self.calls[-1].output = [weakref.ref(t) for t in tensors(output)]

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _covered(calls: list[Call], index: int) -> tuple[list[int], set[int], bool]:
    """The calls a replay of call ``index`` covers, its chain, and whether the step's own code fed a later call inf/nan.

    The chain: it and each later call that took what a chain call gave. Covered: those and each later call that made
    inf/nan of finite inputs on its own (an island fix must cover each).
    """
    covered, chain, fed = [index], {index}, False
    made = {id(t) for t in calls[index].held()}
    ours = set(made)
    for later, call in enumerate(calls[index + 1 :], index + 1):
        took, output = {id(t) for t in tensors((call.args, call.kwargs))}, call.alive()
        bad_in = nonfinite_kind((call.args, call.kwargs), masks="all") is not None
        if took & ours:
            chain.add(later)
            ours.update(id(t) for t in call.held())
        if took & made or (not bad_in and (output is None or nonfinite_kind(output, masks="all"))):
            covered.append(later)
            made.update(id(t) for t in call.held())
        elif bad_in:
            fed = True
    return covered, chain, fed


def _feeding(calls: list[Call], index: int, batch: Any) -> tuple[list[int], bool]:
    """The earlier calls that fed call ``index``, and whether they took only the batch and each other's outputs.

    Else the own code made something they took: a replay would pair values the step never computed together.
    """
    wanted = {id(t) for t in tensors((calls[index].args, calls[index].kwargs))}
    fed: list[int] = []
    for earlier in range(index - 1, -1, -1):
        if wanted & {id(t) for t in calls[earlier].held()}:
            fed.insert(0, earlier)
            wanted.update(id(t) for t in tensors((calls[earlier].args, calls[earlier].kwargs)))
    given = {id(t) for t in tensors(batch)} | {id(t) for i in fed for t in calls[i].held()}
    took = [t for i in [*fed, index] for t in tensors((calls[i].args, calls[i].kwargs)) if t.is_floating_point()]
    return fed, all(id(t) in given for t in took)


def measure(
    origin: Origin,
    record: Any,
    position: int,
    watch: Watch,
    context: Callable[[], Any],
    device: str,
    model: torch.nn.Module,
) -> Origin:
    """``origin`` (a module the watch named at trace ``position``) with its float32 verdict and islands measured.

    Each module born in runs in float32 in the next replay until nothing is born: the islands. Born in again in
    float32: ``nonfinite``, unless the calls that fed it, in float32 too, end it (they join the islands); a chain
    module born in float32 too is the origin. No islands where more than :data:`MAX_ISLANDS` are needed, another call
    makes them on its own in any precision, or the step's own code fed a later call what a replay cannot follow.
    """
    calls: list[Call] = record.calls
    index = max((i for i, c in enumerate(calls) if c.position <= position), default=None)
    if index is None:
        return origin.replace(reason="not measured: its call was not recorded")
    call = calls[index]
    changed = [c.name for c in calls[index:] if [version(t) for t in tensors((c.args, c.kwargs))] != c.versions]
    if changed:
        return origin.replace(
            reason=f"not measured: the step changed the inputs of {changed[0]} in place after the call"
        )
    covered, chain, fed = _covered(calls, index)
    upstream, replayable = _feeding(calls, index, record.batch)
    islands: list[str] = []
    for round in range(MAX_ISLANDS + 2):
        found, outputs, error = _replay([calls[i] for i in covered], islands, watch, context, device, model)
        if error is not None:
            return origin.replace(float32=Verdict.UNKNOWN, reason=f"the replay of {call.name} raised {error}")
        if round == 0 and not _same(outputs[covered.index(index)], call.alive()):
            return origin.replace(reason=f"not measured: the replay of {call.name} computed other values than the step")
        if found is None:
            return origin.replace(float32=Verdict.FINITE, islands=() if fed else tuple(islands))
        name, kind, by = found
        if not name or (round == 0 and name != origin.name):  # what the own code passed on, not replayed
            return origin.replace(float32=Verdict.FINITE if round else None, islands=() if round else None)
        if name in islands and by is not None and by not in islands:  # fed a float16 -inf: where it was made too
            islands.append(by)
            continue
        whole = [calls[i].name for i in [*upstream, index] if calls[i].name not in islands]
        if name in islands and whole and replayable:  # the calls that fed it, and its own, in float32 too
            covered, islands = sorted({*upstream, *covered}), [*islands, *whole]
            continue
        if name in islands:  # float32 makes them too
            if name == origin.name or island_of(name, [calls[i].name for i in chain]):  # it, or inside the chain
                return Origin(origin.phase, name, kind, Verdict.NONFINITE, rank=origin.rank)
            return origin.replace(float32=Verdict.FINITE, islands=())  # another call's, in any precision
        islands.append(name)
    return origin.replace(float32=Verdict.FINITE, islands=())


def _same(replayed: Any, recorded: Optional[list[Tensor]]) -> bool:
    """Whether a replay computed what the step did (where the step still holds it): inf/nan alike, the rest close."""
    if recorded is None:
        return True
    try:
        for x, y in zip(tensors(replayed), recorded, strict=True):
            torch.testing.assert_close(x.detach(), y.detach().to(x.device), rtol=1e-3, atol=1e-6, equal_nan=True)
    except (AssertionError, ValueError, TypeError):
        return False
    return True


def _replay(
    calls: list[Call], islands: list[str], watch: Watch, context: Callable[[], Any], device: str, model: torch.nn.Module
) -> tuple[Optional[tuple[str, str, Optional[str]]], list[Any], Optional[str]]:
    """The calls again, sandboxed and watched, ``islands`` in float32.

    Returns where inf/nan were born (the module, their kind, the module whose float16 ``-inf`` it took), the outputs
    and what it raised.
    """
    replaced: dict[int, Tensor] = {}
    outputs: list[Any] = []
    modules = [c.module for c in calls]  # a compiled one runs eagerly inside the sandbox, watched from outside
    try:
        set_aside = [seen.module for seen in walk(model) if seen.name in islands]
        with (
            watch.apart() as trace,
            sandboxed(modules, device),
            no_logging(model),
            torch.enable_grad(),
            in_float32(set_aside, device),
        ):
            for call, module in zip(calls, modules, strict=True):
                give_back(call.rng)
                args, kwargs = copied_inputs(map_tensors(lambda t: replaced.get(id(t), t), (call.args, call.kwargs)))
                with context():
                    outputs.append(module(*args, **kwargs))
                recorded = [ref() for ref in call.output]
                replaced.update(
                    (id(r), t) for r, t in zip(recorded, tensors(outputs[-1]), strict=False) if r is not None
                )
    except Exception as error:  # noqa: BLE001 - a replay that fails is told, never raised
        return None, outputs, raised(error)
    found, failed = attempt(first_born, read(trace))
    if found is None:
        return None, outputs, failed
    where, kind, _, by, *_ = found
    by_name = watch.names[by] if by is not None else None
    return (watch.names[where] if where is not None else "", kind, by_name), outputs, None
