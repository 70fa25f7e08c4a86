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
    global_streams,
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
                born = self._measured(record, index)
                if born is not None:  # else: finite, or only masks (-inf by design) left the call
                    return born
                if output is not _GONE:
                    by_design.update(id(t) for t in tensors(output))
        if any(nonfinite_kind(loss.detach()) is not None for loss in record.losses):
            # the batch holding inf/nan is said: it may have reached the loss (a target), not told apart
            return Origin(Phase.LOSS, batch_too=nonfinite_kind(record.batch) is not None)
        if self._accumulating:
            return None  # an earlier micro-batch of the update may have made them: not recorded
        return Origin(Phase.BACKWARD)

    def _measured(self, record: BatchCalls, index: int) -> Optional[Origin]:
        """The module inside call ``index`` that made its non-finite output, and the islands that fix it, by replay.

        Replayed with it: every later call that made inf/nan from finite inputs on its own (an island fix must cover
        each), and every later call that took in what one of those returned (as the very tensor, ``x = layer(x)``:
        given the replay's value). A module is born in where its inputs were finite and its output not, no module
        inside it so. Each one found is run in float32 in the next replay (as ``fp32_modules`` runs it): still
        non-finite, no precision avoids it (``-inf`` alone that float32 makes too: a mask or a bias by design, no
        origin); finite, it stays an island, and the replays go on until none is born in: the islands (``()``: more
        than :data:`MAX_ISLANDS`, one float32 does not fix, or a value finite in float32 that does not fit float16
        while the LightningModule's own code passed something made of it to a later call, which may cast it back).
        The first replay must compute what the step did: its output, or, where the step freed that, the random state
        the call left behind.
        """
        calls, name = record.calls, record.calls[index].name
        chain = self._reached(record, [index])
        seeds = [
            later
            for later, c in enumerate(calls)
            if later > index
            and later not in chain
            and nonfinite_kind((c.args, c.kwargs)) is None
            and (_alive(c.output) is _GONE or nonfinite_kind(_alive(c.output)) is not None)
        ]
        positions = self._reached(record, [index, *seeds])
        unseen = any(
            nonfinite_kind((c.args, c.kwargs), masks="inputs") is not None
            for later, c in enumerate(calls)
            if later > index and later not in positions
        )
        islands: list[str] = []  # run in float32 in the next replay, in the order found
        first: dict[str, tuple[int, Optional[str], bool]] = {}  # module -> the call, kind, +inf/nan it was born with
        design: set[str] = set()  # modules whose -inf float32 makes too
        contained = True
        for round in range(2 * MAX_ISLANDS + 4):
            replayed = self._replay(record, positions, islands, design)
            ours = [m for m in islands if first[m][0] == index]
            if index in replayed.errors:
                if not ours:
                    return unknown(f"the replay of {name} raised {replayed.errors[index]}")
                return Origin(Phase.FORWARD, ours[0], first[ours[0]][1], Verdict.UNKNOWN)
            if round == 0:
                held = _alive(calls[index].output)
                if held is _GONE and nonfinite_kind(replayed.outputs[index]) is None:
                    return None  # it made nothing non-finite (its output was freed: replayed to see)
                odd = [i for i in positions if i not in replayed.errors and not _alike(calls[i], replayed, i)]
                if index in odd:
                    return Origin(
                        Phase.FORWARD,
                        within=name,
                        kind=nonfinite_kind(replayed.outputs[index] if held is _GONE else held),
                        reason=f"nondeterministic: the replay of {name} computed other values than the step",
                    )
                contained = not odd
            contained = contained and not replayed.errors
            tried = list(islands)
            born: dict[str, tuple[int, str, str, bool]] = {}
            for birth in replayed.births:
                born.setdefault(birth[1], birth)  # a module's first birth in the replay
            for position, module, kind, real in born.values():
                if module not in islands:
                    islands.append(module)
                    first[module] = (position, kind, real)
                elif not (real or first[module][2]):
                    islands.remove(module)  # -inf alone, which float32 makes too: by design
                    design.add(module)
                elif ours and module == ours[0]:
                    return Origin(Phase.FORWARD, module, first[module][1], Verdict.NONFINITE)
                else:
                    contained = False  # float32 does not fix it
            ours = [m for m in islands if first[m][0] == index]
            if not ours:
                if not any(birth[0] == index for birth in replayed.births):
                    return None  # finite, or only masks (-inf by design) left the call
            elif ours[0] in tried and (not contained or not replayed.births or len(islands) > MAX_ISLANDS):
                outputs = [replayed.outputs.get(i) for i in chain]
                fixed = contained and not replayed.births and len(islands) <= MAX_ISLANDS
                fixed = fixed and nonfinite_kind(outputs, masks=True) is None and (not unseen or fits_float16(outputs))
                islands = [ours[0], *(m for m in islands if m != ours[0])] if fixed else []
                return Origin(Phase.FORWARD, ours[0], first[ours[0]][1], Verdict.FINITE, islands=tuple(islands))
        return unknown(f"the replays of {name} found no end")

    @staticmethod
    def _reached(record: BatchCalls, seeds: list[int]) -> list[int]:
        """``seeds`` and every later call that took in, as the very tensor, what a call reached returned."""
        reached: list[int] = []
        made: set[int] = set()
        for later in range(seeds[0], len(record.calls)):
            call = record.calls[later]
            if later in seeds or any(id(t) in made for t in tensors((call.args, call.kwargs))):
                reached.append(later)
                made.update(id(t) for t in tensors(_alive(call.output)))
        return reached

    def _replay(self, record: BatchCalls, positions: list[int], islands: list[str], design: set[str]) -> _Replayed:
        """The calls ``positions`` again, sandboxed, each from its own start, every module in them watched.

        A call takes in what an earlier one returned in this replay where it took in what that one recorded;
        ``islands`` run in float32, as ``AmpPlusPrecision(fp32_modules=...)`` runs them; ``design``: modules whose
        ``-inf`` is by design.
        """
        model = self._module
        assert model is not None
        calls = [record.calls[i] for i in positions]
        frontier = [(c.name, resolve_module(c.module)) for c in calls]  # a compiled module replays eagerly
        roots = (*(inner for _, inner in frontier), *((c.args, c.kwargs) for c in calls))  # what its code reaches
        owned = [stream for stream, _ in (record.start[2] or [])] if record.start is not None else []
        replayed = _Replayed()

        def run() -> None:
            with sandboxed(roots, self._device_type, grad=True, streams=owned), no_logging(model), torch.enable_grad():
                watch = _Watch(frontier, self._device_type, islands, design)
                replaced: dict[int, Tensor] = {}
                try:
                    for index, call, (_, module) in zip(positions, calls, frontier, strict=True):
                        start = record.step_start(index, owned=index == positions[0], host=False)
                        if start is not None:
                            start.restore()
                        given = map_tensors(lambda t: replaced.get(id(t), t), (call.args, call.kwargs))
                        watch.position, watch.open = index, []
                        with self._forward_context():
                            output, error = attempt(_called, module, given)
                        cuda = self._cuda_state() if self._cuda_state is not None else None
                        replayed.after[index] = (torch.default_generator.get_state(), cuda)
                        replayed.outputs[index] = output
                        if error is not None:
                            replayed.errors[index] = error
                            continue
                        replaced.update(zip(map(id, tensors(_alive(call.output))), tensors(output), strict=False))
                finally:
                    watch.remove()
                replayed.births = watch.births

        _, error = attempt(run)
        if error is not None:
            replayed.errors.setdefault(positions[0], error)
        return replayed


@dataclass
class _Replayed:
    """What a replay gave, by call: outputs, what one raised, torch's random state after; and the modules born in."""

    outputs: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    after: dict[int, tuple[Tensor, Optional[Tensor]]] = field(default_factory=dict)
    births: list[tuple[int, str, str, bool]] = field(default_factory=list)  # call, module, kind, +inf or nan


def _called(module: torch.nn.Module, given: tuple[Any, Any]) -> Any:
    return module(*copied_inputs(given[0]), **copied_inputs(given[1]))


def _alike(call: Call, replayed: _Replayed, index: int) -> bool:
    """Whether a replay computed what the step did: the call's output, or (freed) the random state it left."""
    held = _alive(call.output)
    if held is not _GONE:
        return same_values(replayed.outputs[index], held)
    after, cuda = replayed.after[index]
    return torch.equal(after, call.torch_after) and (
        call.cuda_after is None or (cuda is not None and torch.equal(cuda, call.cuda_after))
    )


class _Watch:
    """Hooks on every module inside the replayed calls: each born in (inputs finite, output not, none inside it so).

    ``islands`` run in float32 (as ``AmpPlusPrecision(fp32_modules)``); a ``design`` module's ``-inf`` is no birth.
    """

    def __init__(
        self, frontier: list[tuple[str, torch.nn.Module]], device_type: str, islands: list[str], design: set[str]
    ) -> None:
        self.births: list[tuple[int, str, str, bool]] = []
        self.position = -1  # the call replayed
        self.open: list[int] = []  # the births found when each module now running started
        self._names: dict[int, str] = {}
        self._design = design
        self._handles: list[Any] = []
        for name, inner in frontier:
            for sub, module in inner.named_modules():
                if id(module) in self._names:
                    continue
                self._names[id(module)] = clean_name(f"{name}.{sub}" if sub else name)
                if self._names[id(module)] in islands and "forward" not in vars(module):
                    module.forward = fp32_forward(module.forward, device_type)  # type: ignore[method-assign]
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()  # the island wrappers go with the sandbox (it puts every attribute back)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.open.append(len(self.births))

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if len(self.births) > (self.open.pop() if self.open else len(self.births)):
            return  # a module inside it was born in: it passed them on
        kind = nonfinite_kind(output)
        if kind is None or nonfinite_kind((args, kwargs), masks="inputs") is not None:
            return
        name = self._names[id(module)]
        real = nonfinite_kind(output, masks="all") is not None  # +inf or nan: never by design
        if real or name not in self._design:
            self.births.append((self.position, name, kind, real))


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
