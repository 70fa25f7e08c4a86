"""OriginFinder: where a skipped update's inf/nan were born, read from what the step computed.

One component that :class:`~lightning_amp_plus.NaNSkipReporter` holds (and, through it, ``AmpAdvisor``). On every
training batch it keeps, by reference, the calls of the modules the LightningModule calls (its children; the children
of a container such as ``nn.ModuleList``): their inputs, their outputs, and torch's random state after each. On a
skipped update it reads them: the first call whose inputs were finite and whose output was not is where the values
were born, and only that call is replayed, in a :func:`~lightning_amp_plus.sandbox.sandboxed` copy of the model from
the random state it started from, with every module inside it hooked, to name the module inside. The replay must
give back the very output the step computed; when it does not (a module that draws from a stream the step's start
did not record), the origin says so instead of naming a module. The module found is recomputed in float32 (an fp16
overflow is finite there; a NaN the model makes in any precision is not), and for an overflow the replay is run
again with that module in float32, and then the next one the value overflows in, until the call's output is finite:
the islands a fix needs, measured. ``training_step`` is never run again, and nothing here raises into training: a
replay that fails is told (``{"phase": "unknown", "reason": ...}``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper, resolve_module
from lightning_amp_plus._limits import MAX_ISLANDS
from lightning_amp_plus._tree import map_tensors, tensors, values, version
from lightning_amp_plus.islands import fp32_forward
from lightning_amp_plus.origin import OWN_CODE, Origin, Phase, Verdict, unknown
from lightning_amp_plus.sandbox import (
    StepStart,
    _replays,
    attempt,
    capture,
    copied_inputs,
    give_back,
    global_streams,
    holds_state,
    no_logging,
    raised,
    reach,
    sandboxed,
)

#: which ``-inf`` counts as non-finite: every one (False); all but an additive mask's (True: the batch); only a
#: half-precision tensor's that is no mask ("inputs": what a call takes in); none ("all": a module's output)
Masks = Union[bool, Literal["inputs", "all"]]


class Call(NamedTuple):
    """One recorded module call; ``torch_after``/``cuda_after``: torch's generators after it (the next one's start).

    ``output`` is held weakly once the batch's loss is known; ``versions``: its tensors' version counters then.
    """

    name: str
    module: torch.nn.Module
    args: Any
    kwargs: Any
    output: Any
    versions: list[int]
    torch_after: Tensor
    cuda_after: Optional[Tensor]


@dataclass
class BatchCalls:
    """One batch's record: the batch, its module calls, its losses and the random state it started with."""

    batch: Any = None
    calls: list[Call] = field(default_factory=list)
    losses: list[Tensor] = field(default_factory=list)
    start: Optional[tuple[Tensor, Optional[Tensor], Optional[list[tuple[Any, Any]]]]] = None
    index: int = -1
    host: Optional[list[tuple[Any, Any]]] = None  # Python's and numpy's random state, when a rerun may need them
    weak: int = 0  # the calls whose outputs are held weakly (those recorded before a backward)
    failed: Optional[str] = None  # why a call could not be recorded (then the origin is told unknown, with it)

    def step_start(self, index: int = 0, owned: bool = True, host: bool = True) -> Optional[StepStart]:
        """The random state call ``index`` started from (0: the whole step's, for a rerun of ``training_step``).

        Torch's as the call before it left them (or as the batch began); as the batch began, the streams the module
        tree holds (``owned``: a replay's first call restores them) and Python's and numpy's (``host``: a rerun).
        """
        if self.start is None:
            return None
        torch_state, cuda_state, streams = self.start
        if index > 0:
            torch_state, cuda_state = self.calls[index - 1].torch_after, self.calls[index - 1].cuda_after
        return StepStart(torch_state, cuda_state, streams if owned else None, self.host if host else None)


class OriginFinder:
    """Tell where a skipped update's non-finite values were born (Trainer; see the module docstring).

    Use :meth:`attach` at fit start, :meth:`start_batch` / :meth:`add_loss` / :meth:`take_batch` around each training
    batch, and :meth:`origin` on a skip (what recording costs: the Performance page).

    Example:
        >>> import torch
        >>> finder = OriginFinder()
        >>> finder.origin(BatchCalls(batch=torch.tensor([float("nan")]))).to_dict()
        {'phase': 'input'}
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._module: Optional[torch.nn.Module] = None
        self._forward_context: Callable[[], Any] = contextlib.nullcontext
        self._current: Optional[BatchCalls] = None
        self._accumulating = False
        self._device_type = "cpu"
        self._owned: list[Any] = []
        self._cuda_state: Optional[Callable[[], Tensor]] = None

    # ------------------------------------------------------------------ recording
    def attach(self, module: torch.nn.Module, forward_context: Callable[[], Any], accumulating: bool = False) -> None:
        """Record the calls of ``module``'s call frontier; replays run under ``forward_context`` (autocast).

        ``accumulating``: updates span several micro-batches, of which only the last is recorded, so a finite
        replay cannot say "backward".
        """
        self.detach()
        if getattr(module, "_compiler_ctx", None) is not None:
            return  # compiled as a whole: a hook would be traced into its graph and change what it computes
        self._module = module
        self._forward_context = forward_context
        self._accumulating = accumulating
        self._device_type = _device_type(module)
        self._owned = reach(module).streams  # each batch starts them where the step does: a replay draws alike
        cuda = self._device_type == "cuda" and torch.cuda.is_available()
        self._cuda_state = torch.cuda.default_generators[torch.cuda.current_device()].get_state if cuda else None
        cpu_state = torch.default_generator.get_state
        for name, called in call_frontier(module):
            if isinstance(called, torch.jit.ScriptModule):
                continue  # no hook on a scripted module: its calls are not recorded

            def keep(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
                current = self._current
                if current is None or _replays[0] or current.failed:  # training batches only, not replays
                    return
                cuda_state = self._cuda_state
                try:
                    kept = versions(args, kwargs, output)
                except Exception as error:  # noqa: BLE001 - what the call holds cannot be read: told, never raised
                    current.failed = f"reading the call of {name} raised {raised(error)}"
                    return
                cuda_after = cuda_state() if cuda_state is not None else None
                # a tuple made in C: a call recorded costs no Python call of its own
                current.calls.append(
                    tuple.__new__(Call, (name, mod, args, kwargs, output, kept, cpu_state(), cuda_after))
                )

            with contextlib.suppress(RuntimeError):  # a module that refuses hooks is not recorded
                self._handles.append(called.register_forward_hook(keep, with_kwargs=True))

    def detach(self) -> None:
        """Stop recording; forget the batch."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._current = None

    def start_batch(self, batch: Any, index: int = -1, host: bool = False) -> None:
        """Record this training batch's calls from now on, and the random state it starts with.

        ``host``: Python's and numpy's global random state too (a rerun of ``training_step`` draws from them).
        """
        owned = capture(self._owned) if self._owned else None
        cuda_state = self._cuda_state
        start = (torch.default_generator.get_state(), cuda_state() if cuda_state is not None else None, owned)
        kept = capture(global_streams()[1:]) if host else None  # torch's is in `start`
        self._current = BatchCalls(batch=batch, start=start, index=index, host=kept)

    def add_loss(self, loss: Tensor) -> None:
        """A loss of this batch (a GAN backpropagates two), just before its backward.

        From here the calls' outputs are held weakly: an output only the step held (the logits) is freed as it would
        be without the finder; one a later call took as input stays, held by that call's record.
        """
        current = self._current
        if current is None:
            return
        current.losses.append(loss)
        calls = current.calls
        for index in range(current.weak, len(calls)):
            call = calls[index]
            output = call.output  # a tensor inline: this runs once a call, every batch
            held = weakref.ref(output) if type(output) is Tensor else _Weak(output)
            calls[index] = tuple.__new__(Call, (*call[:4], held, *call[5:]))
        current.weak = len(calls)

    def take_batch(self) -> Optional[BatchCalls]:
        """This batch's record, handed over (for a replay later); recording stops until the next batch."""
        current, self._current = self._current, None
        return current

    @property
    def current(self) -> Optional[BatchCalls]:
        """The batch being recorded (None between batches)."""
        return self._current

    # ------------------------------------------------------------------ telling
    def origin(self, record: Optional[BatchCalls] = None) -> Optional[Origin]:
        """Where ``record``'s (default: this batch's) non-finite values were born; None when it cannot be told.

        * :attr:`Phase.INPUT`: the batch held inf/nan, and they reached the model (a module's inputs or the loss);
        * :attr:`Phase.FORWARD`: the first module (in execution order) whose inputs were finite and whose output was
          not (:data:`OWN_CODE`: the LightningModule's own code between its modules), with ``kind`` and ``float32``:
          its output recomputed in float32 (finite: an fp16 overflow; non-finite: no precision avoids it), and for
          an overflow ``islands``: the modules that had to run in float32 for the call's output to be finite,
          measured by replay (``()``: none do within :data:`MAX_ISLANDS`). When the replay could not be made to
          compute what the step computed, ``module`` is None, ``within`` names the call and ``reason`` says why;
        * :attr:`Phase.LOSS`: every recorded module output finite, the loss not;
        * :attr:`Phase.BACKWARD`: forward and loss finite;
        * :attr:`Phase.UNKNOWN`, with its ``reason``: it could not be told (the replay raised, say).
        """
        record = record if record is not None else self._current
        if record is None or record.batch is None:
            return None
        if record.failed:
            return unknown(record.failed)
        told, error = attempt(self._tell, record)
        return unknown(f"telling it raised {error}") if error is not None else told

    def _tell(self, record: BatchCalls) -> Optional[Origin]:
        in_batch = nonfinite_kinds(record.batch, masks=True)  # an additive mask's -inf is no bad data
        if self._module is None:
            return Origin(Phase.INPUT) if in_batch else None  # not recorded (sharded, compiled): only the batch is told
        by_design: set[int] = set()  # outputs of calls whose -inf float32 makes too (a mask, a bias): no origin
        for index, (name, _, args, kwargs, held, kept, _, _) in enumerate(record.calls):
            output = _alive(held)
            now = versions(args, kwargs, None if output is _GONE else output)
            if now != (kept if output is not _GONE else kept[: kept[0] + 1]):  # a freed output changes no more
                return unknown(f"the step changed the inputs or the output of {name} in place after the call")
            took = [t for t in tensors((args, kwargs)) if id(t) not in by_design]
            from_batch = nonfinite_kinds(took, masks=True)
            if from_batch and from_batch <= in_batch and _from_batch(record.batch, took):
                return Origin(Phase.INPUT)
            taken = nonfinite_kinds(took, masks="inputs")
            if taken:  # made before this call by the LightningModule's own code
                # the batch holding that kind too is said: the step may have spread it
                return Origin(
                    Phase.FORWARD, OWN_CODE, "inf" if "inf" in taken else "nan", batch_too=bool(taken & in_batch)
                )
            if output is _GONE or nonfinite_kind(output) is not None:
                born = self._inside(record, index)
                if born is not None:  # else: finite, or only masks (-inf by design) left the call
                    return self._with_later_births(record, index, born)
                if output is not _GONE:
                    by_design.update(id(t) for t in tensors(output))
        if any(nonfinite_kind(loss.detach()) is not None for loss in record.losses):
            # the batch holding inf/nan is said: it may have reached the loss (a target), not told apart
            return Origin(Phase.LOSS, batch_too=nonfinite_kind(record.batch) is not None)
        if self._accumulating:
            return None  # an earlier micro-batch of the update may have made them: not recorded
        return Origin(Phase.BACKWARD)

    def _with_later_births(self, record: BatchCalls, index: int, born: Origin) -> Origin:
        """``born`` with the islands of every later call that also made inf/nan from finite inputs (on its own).

        An island fix must cover each module whose float16 output overflows in the step, not only the first.
        """
        if not born.islands:
            return born
        islands = list(born.islands)
        chain = self._chain(record, index)  # the calls that took in what it made: the islands cover them already
        for later in range(index + 1, len(record.calls)):
            call = record.calls[later]
            output = _alive(call.output)
            if later in chain or nonfinite_kind((call.args, call.kwargs)) is not None:
                continue  # it took in what an earlier call made
            if output is not _GONE and nonfinite_kind(output) is None:
                continue  # it made nothing (an output the step freed: the replay below tells)
            also = self._inside(record, later)
            if also is None:
                continue
            if not also.islands:  # not contained, or not measured (a NaN, a replay unlike the step)
                return born.but(islands=())
            islands.extend(i for i in also.islands if i not in islands)
        return born.but(islands=tuple(islands))

    def _inside(self, record: BatchCalls, index: int) -> Optional[Origin]:
        """Replay call ``index`` to name the module inside it that made its non-finite output (if it made one).

        The replay must compute what the step did: its output, or, where the step freed that, the random state the
        call left behind.
        """
        name, _, args, kwargs, held, _, torch_after, cuda_after = record.calls[index]
        output = _alive(held)
        first = self._replay(record, [index], islands=[])
        if first.error is not None:
            return unknown(f"the replay of {name} raised {first.error}")
        if output is _GONE:
            if nonfinite_kind(first.outputs[0]) is None:
                return None  # it made nothing non-finite (its output was freed: replayed to see)
            after = first.after
            alike = after is not None and torch.equal(after[0], torch_after)
            alike = alike and (
                cuda_after is None or (after is not None and after[1] is not None and torch.equal(after[1], cuda_after))
            )
        else:
            alike = same_values(first.outputs[0], output)
        if not alike:
            return Origin(
                Phase.FORWARD,
                within=name,
                kind=nonfinite_kind(first.outputs[0] if output is _GONE else output),
                reason=f"nondeterministic: the replay of {name} computed other values than the step",
            )
        born = first.found
        if born is not None and born.float32 is Verdict.FINITE:
            islands = self._islands(record, index, born.name)
            return born.but(islands=tuple(islands) if islands is not None else ())
        return born

    def _islands(self, record: BatchCalls, index: int, module: str) -> Optional[list[str]]:
        """The modules that must run in float32, ``module`` first, for what the call made to stay finite (measured).

        The replay follows what the call returned into every later call that took it in as it came (``x =
        layer(x)``), so an island whose float32 output the next module casts back to float16 is seen to move the
        overflow there, and that module joins. None when more than :data:`MAX_ISLANDS` are needed, or when the
        value, finite in float32, does not fit float16 while the LightningModule's own code passed something made
        of it to a later call (where it may be cast to float16 again: an island cannot be shown to fix it).
        """
        chain = self._chain(record, index)
        unseen = any(
            nonfinite_kind((c.args, c.kwargs), masks="inputs") is not None
            for later, c in enumerate(record.calls)
            if later > index and later not in chain
        )
        islands = [module]
        while len(islands) <= MAX_ISLANDS:
            again = self._replay(record, chain, islands)
            if again.error is not None:
                return None
            if again.found is None and nonfinite_kind(again.outputs, masks=True) is None:
                return islands if not unseen or fits_float16(again.outputs) else None
            if again.found is None or again.found.float32 is not Verdict.FINITE or again.found.name in islands:
                return None
            islands.append(again.found.name)
        return None

    @staticmethod
    def _chain(record: BatchCalls, index: int) -> list[int]:
        """Call ``index`` and every later call that took in, as the very tensor, what a call of the chain returned."""
        chain = [index]
        made = {id(t) for t in tensors(_alive(record.calls[index].output))}
        for later in range(index + 1, len(record.calls)):
            call = record.calls[later]
            if any(id(t) in made for t in tensors((call.args, call.kwargs))):
                chain.append(later)
                made.update(id(t) for t in tensors(_alive(call.output)))
        return chain

    def _replay(self, record: BatchCalls, indices: list[int], islands: list[str]) -> _Replayed:
        """The calls ``indices`` again, sandboxed, each from its own start, every module in them hooked.

        A later call takes in what an earlier one of them returned in place of what it recorded (``islands``: the
        modules run in float32, as ``AmpPlusPrecision(fp32_modules=...)`` runs them).
        """
        model = self._module
        assert model is not None
        calls = [record.calls[i] for i in indices]
        result = _Replayed()

        frontier = [(c.name, resolve_module(c.module)) for c in calls]  # a compiled module replays eagerly
        roots = (*(inner for _, inner in frontier), *((c.args, c.kwargs) for c in calls))  # what its code reaches
        owned = [stream for stream, _ in (record.start[2] or [])] if record.start is not None else []  # set below

        def run() -> None:
            with (
                sandboxed(roots, self._device_type, grad=True, streams=owned) as box,
                no_logging(model),
                torch.enable_grad(),
            ):
                watch = _FirstBorn(frontier, self._device_type, box.streams)
                replaced: dict[int, Tensor] = {}
                try:
                    watch.install(islands)
                    for position, (index, (_, _, args, kwargs, held, *_)) in enumerate(
                        zip(indices, calls, strict=True)
                    ):
                        start = record.step_start(index, owned=position == 0, host=False)
                        if start is not None:
                            start.restore()
                        given = map_tensors(lambda t: replaced.get(id(t), t), (args, kwargs))
                        with self._forward_context():
                            output = frontier[position][1](*copied_inputs(given[0]), **copied_inputs(given[1]))
                        if position == 0:  # the random state the call left: the step's, if the replay was alike
                            cuda = (
                                torch.cuda.default_generators[torch.cuda.current_device()] if self._cuda_state else None
                            )
                            result.after = (torch.default_generator.get_state(), cuda.get_state() if cuda else None)
                        result.outputs.append(output)
                        replaced.update(zip(map(id, tensors(_alive(held))), tensors(output), strict=False))
                finally:
                    watch.remove()
                result.found = watch.found

        _, result.error = attempt(run)
        return result


@dataclass
class _Replayed:
    """What a replay of calls gave: their outputs, the first module that made inf/nan in them, or what it raised."""

    outputs: list[Any] = field(default_factory=list)
    found: Optional[Origin] = None
    error: Optional[str] = None
    after: Optional[tuple[Tensor, Optional[Tensor]]] = None  # torch's random state after the first call


class _FirstBorn:
    """Hooks on every module inside one call: the first whose inputs were finite and whose output was not.

    That module is recomputed in float32 on the inputs it had, from the random state it started with (and the
    replay's state put back after): an fp16 overflow is finite there; ``-inf`` that float32 makes too is a mask by
    design, not an origin.
    """

    def __init__(self, frontier: list[tuple[str, torch.nn.Module]], device_type: str, streams: list[Any]) -> None:
        self.found: Optional[Origin] = None
        self._names: dict[int, str] = {}
        self._modules: list[torch.nn.Module] = []
        for name, inner in frontier:
            for sub, module in inner.named_modules():
                if id(module) not in self._names:
                    self._names[id(module)] = clean_name(f"{name}.{sub}" if sub else name)
                    self._modules.append(module)
        self._device_type = device_type
        self._streams = [*global_streams(device_type), *streams]
        self._starts: dict[int, list[tuple[Any, list[tuple[Any, Any]], Any]]] = {}
        self._handles: list[Any] = []
        self._recomputing = False

    def install(self, islands: list[str]) -> None:
        """Hook every module; run those named in ``islands`` in float32 (as ``AmpPlusPrecision(fp32_modules)``)."""
        for module in self._modules:
            if self._names[id(module)] in islands and "forward" not in vars(module):
                module.forward = fp32_forward(module.forward, self._device_type)  # type: ignore[method-assign]
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []  # the island wrappers go with the sandbox (it puts every attribute back)

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.found is None and not self._recomputing:
            # a recompute starts where the call did: its random state, and a copy of an argument the call may change
            before = attempt(lambda: copied_inputs((args, kwargs)))[0] if holds_state((args, kwargs)) else None
            self._starts.setdefault(id(module), []).append((versions(args, kwargs), capture(self._streams), before))

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._recomputing:
            return
        starts = self._starts.get(id(module))
        kept, start, before = starts.pop() if starts else (None, None, None)
        if self.found is not None or start is None:
            return
        kind = nonfinite_kind(output)
        if kind is None or nonfinite_kind((args, kwargs), masks="inputs") is not None:
            return
        inputs = before  # copies taken before the call, when an argument holds state (a cache the call appends to)
        if inputs is None and versions(args, kwargs) == kept and not holds_state((args, kwargs)):
            inputs = (args, kwargs)  # else it changed its own inputs: they are not what it was called with
        real = nonfinite_kind(output, masks="all") is not None  # +inf or nan: never by design
        masks: Masks = "all" if real else False
        float32 = Verdict.UNKNOWN if inputs is None else self._float32(module, inputs[0], inputs[1], start, masks)
        if not real and float32 is not Verdict.FINITE:
            return  # -inf alone, which float32 makes too: by design (a mask, a position bias)
        self.found = Origin(Phase.FORWARD, self._names[id(module)], kind, float32)

    def _float32(
        self, module: torch.nn.Module, args: Any, kwargs: Any, start: list[tuple[Any, Any]], masks: Masks
    ) -> Verdict:
        """``module`` on the same inputs in float32 (unknown: it raised)."""
        now = capture(self._streams)
        self._recomputing = True
        try:
            give_back(start)
            with torch.autocast(self._device_type, enabled=False), torch.no_grad():
                output, error = attempt(lambda: module(*_up(args), **_up(kwargs)))
        finally:
            self._recomputing = False
            give_back(now)
        if error is not None:
            return Verdict.UNKNOWN
        return Verdict.FINITE if nonfinite_kind(output, masks=masks) is None else Verdict.NONFINITE


def _up(value: Any) -> Any:
    """A call's arguments copied, half floats made float32 (a recompute never writes what the replay goes on with)."""
    return map_tensors(lambda t: t.detach().float() if t.is_floating_point() else t.detach().clone(), value)


def _from_batch(batch: Any, took: list[Tensor]) -> bool:
    """Whether the non-finite values a call took in can be the batch's (its kinds checked before).

    Yes when one is a batch tensor holding them, or a view of one. Else, per sample: every sample (first dimension)
    where the call's tensors hold them must be one where the batch does, as the batch's values carried on by the
    step's own code keep to their samples; NaN-coded labels at some samples do not make the own code's overflow, at
    every sample, the batch's. A tensor of another first dimension cannot be compared: not shown the batch's (the
    origin is then the step's own code, told with ``"batch": "nonfinite"``).
    """
    bad = [t for t in values(batch) if t.is_floating_point() and _kinds(t, True)]
    shared = {t.untyped_storage().data_ptr() for t in bad}
    if any(t.untyped_storage().data_ptr() in shared for t in values(took)):
        return True
    rows: dict[int, set[int]] = {}
    for t in bad:
        if t.dim():
            rows.setdefault(t.shape[0], set()).update(_bad_rows(t))
    told = [t for t in values(took) if t.is_floating_point() and t.dim() and _kinds(t, True)]
    if not told or any(t.shape[0] not in rows for t in told):
        return False  # no sample to compare (flattened, another first dimension): not shown to be the batch's
    return all(_bad_rows(t) <= rows[t.shape[0]] for t in told)


def _bad_rows(tensor: Tensor) -> set[int]:
    """The samples (first dimension) where ``tensor`` holds a non-finite value an additive mask does not explain."""
    inf, nan = _counted(tensor.detach(), True)
    bad = (inf | nan).reshape(tensor.shape[0], -1).any(1)
    return {int(i) for i in bad.nonzero().flatten().tolist()}


#: how much an origin tells, most first: a rank that saw the inf/nan born outranks one whose forward was finite
_TELLING = [Phase.INPUT, Phase.LOSS, Phase.FORWARD, Phase.BACKWARD, Phase.UNKNOWN]


def job_origin(per_rank: list[Optional[Origin]]) -> Optional[Origin]:
    """The origin of one skipped update from every rank's: the most telling one, with the ``rank`` that saw it.

    With DDP every rank skips the update (its gradients are averaged), yet only the rank whose batch, loss or forward
    made the inf/nan can tell where they were born; the others see a finite forward and would say "backward".

    Example:
        >>> job_origin([Origin(Phase.BACKWARD), Origin(Phase.INPUT)]).to_dict()
        {'phase': 'input', 'rank': 1}
        >>> job_origin([None, None]) is None
        True
    """
    told = [(rank, o) for rank, o in enumerate(per_rank) if o]
    if not told:
        return None
    if len(per_rank) == 1:
        return told[0][1]
    rank, origin = min(told, key=lambda pair: (_TELLING.index(pair[1].phase), pair[0]))
    return origin.but(rank=rank)


def call_frontier(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules ``module``'s own code calls: its children, and a container's children in its place.

    A container (``nn.ModuleList``, ``nn.ModuleDict``, any module without a ``forward`` of its own) is never called
    itself: its children are.

    Example:
        >>> from torch import nn
        >>> m = nn.Module()
        >>> m.layers, m.head = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]), nn.Linear(2, 1)
        >>> [name for name, _ in call_frontier(m)]
        ['layers.0', 'layers.1', 'head']
    """
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, torch.jit.ScriptModule):
            yield qualified, child  # called whole (its class's `forward` is scripted, not Python)
            continue
        container = type(child).forward is torch.nn.Module.forward and "forward" not in vars(child)
        if container and not is_compiled_wrapper(child):  # `_forward_unimplemented`: never called itself
            yield from call_frontier(child, f"{qualified}.")
        else:
            yield qualified, child


def _device_type(module: torch.nn.Module) -> str:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device.type
    first = next(iter(module.parameters()), None)
    return first.device.type if first is not None else "cpu"


def nonfinite_kind(value: Any, masks: Masks = False) -> Optional[str]:
    """``"inf"`` or ``"nan"`` for the first floating tensor in ``value`` (nested lists, tuples, dicts) holding one.

    With ``masks``, an additive mask's ``-inf`` does not count: a tensor whose finite values take two values at most
    (0 / ``-inf``; 0 / -1e4 / ``-inf``), as attention masks hold by design. ``masks="inputs"`` (what a call takes in):
    besides, ``-inf`` counts only in a half-precision tensor (a float16 sum or product that overflowed; float32 does
    not overflow there, its ``-inf`` is a mask or a bias by design). ``masks="all"``: no ``-inf`` counts (a module's
    output, whose float32 recompute tells an overflow from a mask or a bias by design).
    """
    for tensor in values(value):
        kinds = _kinds(tensor, masks)
        if kinds:
            return "inf" if "inf" in kinds else "nan"
    return None


def nonfinite_kinds(value: Any, masks: Masks = False) -> set[str]:
    """Every kind (``"inf"``, ``"nan"``) the floating tensors in ``value`` hold, read as :func:`nonfinite_kind`."""
    return {kind for tensor in values(value) for kind in _kinds(tensor, masks)}


def _kinds(tensor: Tensor, masks: Masks) -> set[str]:
    if not tensor.is_floating_point():
        return set()
    inf, nan = _counted(tensor, masks)
    return {kind for kind, found in (("inf", inf), ("nan", nan)) if bool(found.any())}


def _counted(tensor: Tensor, masks: Masks) -> tuple[Tensor, Tensor]:
    """The one ``-inf`` rule (see :func:`nonfinite_kind`): ``tensor``'s inf elements that count, and its NaN ones."""
    inf = torch.isposinf(tensor)
    if masks != "all" and (masks != "inputs" or tensor.dtype in (torch.float16, torch.bfloat16)):
        minus = torch.isneginf(tensor)
        if bool(minus.any()) and not (masks and _mask_like(tensor)):
            inf = inf | minus
    return inf, torch.isnan(tensor)


def _mask_like(tensor: Tensor) -> bool:
    """Whether ``tensor``'s ``-inf`` is an additive mask's: its finite values (if any) two values at most (0, -1e4)."""
    finite = tensor[torch.isfinite(tensor)]
    return not finite.numel() or bool(((finite == finite.min()) | (finite == finite.max())).all())


def fits_float16(value: Any) -> bool:
    """Whether every floating tensor in ``value`` fits float16's range (below 65504 in magnitude, ``-inf`` aside)."""
    for tensor in values(value):
        if tensor.is_floating_point():
            finite = tensor[torch.isfinite(tensor)]
            if finite.numel() and bool(finite.abs().max() >= 65504.0):
                return False
    return True


def same_values(replayed: Any, recorded: Any) -> bool:
    """Whether a replay computed what the step did: alike tensors, inf/nan in the same places, the rest equal.

    Equal up to a relative 1e-3, for kernels whose float sums are not bitwise repeatable (atomics on a GPU); a replay
    that drew other random numbers (other dropout masks, another layer dropped) differs far beyond that.
    """
    a, b = list(values(replayed)), list(values(recorded))
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not x.is_floating_point():
            if not torch.equal(x, y.to(x.device)):
                return False
            continue
        x, y = x.detach(), y.detach().to(x.device)
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            if not torch.equal(test(x), test(y)):
                return False
        finite = torch.isfinite(x)
        if not torch.allclose(x[finite].float(), y[finite].float(), rtol=1e-3, atol=1e-6):
            return False
    return True


def versions(args: Any, kwargs: Any, output: Any = None) -> list[int]:
    """How many version counters a call's arguments hold, then theirs, then its output's.

    An in-place change later shows as another number. An inference tensor (``torch.inference_mode``) has none: it
    counts as -1 (it cannot be changed in place after).
    """
    found = [0]
    for arg in args:  # flat arguments, the common case, without a nested walk
        if isinstance(arg, Tensor):
            found.append(-1 if arg.is_inference() else arg._version)
        elif not isinstance(arg, (int, float, str, bool, type(None))):
            found.extend(version(t) for t in tensors(arg))
    if kwargs:
        found.extend(version(t) for t in tensors(kwargs))
    found[0] = len(found) - 1
    if isinstance(output, Tensor):
        found.append(-1 if output.is_inference() else output._version)
    elif output is not None:
        found.extend(version(t) for t in tensors(output))
    return found


#: an output the step freed (held weakly once its forward was done)
_GONE = object()


class _Weak:
    """A call's output held weakly: the tensors in it (in :func:`tensors` order), each a weak reference.

    The step frees what only it held (the logits of a model's output dict), as it would without the finder; what a
    reading needs of an output is its tensors.
    """

    __slots__ = ("refs",)

    def __init__(self, output: Any) -> None:
        self.refs = [weakref.ref(t) for t in tensors(output)]


def _alive(held: Any) -> Any:
    """What a record holds: the output (its tensors, when held weakly), or :data:`_GONE` if the step freed one."""
    if isinstance(held, weakref.ref):
        output = held()
        return _GONE if output is None else output
    if isinstance(held, _Weak):
        found = [ref() for ref in held.refs]
        return _GONE if any(t is None for t in found) else found
    return held
