"""OriginFinder: where a skipped update's inf/nan were born, read from what the step computed.

Each training batch it keeps, by reference, the calls of the modules the LightningModule calls (inputs, outputs,
torch's random state after each). On a skip it replays, sandboxed, the first call whose finite inputs gave a
non-finite output, from the random state it started from, every module inside watched, then again with each module
found in float32 until nothing is born: the module, its float32 verdict and the islands, measured. ``training_step``
is never run again, and nothing here raises into training: a replay that fails is told.
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
    """One recorded module call; ``output`` held weakly once the loss is known, ``versions`` its tensors' then."""

    name: str
    module: torch.nn.Module
    args: Any
    kwargs: Any
    output: Any
    versions: list[int]
    torch_after: Tensor  # torch's generators after the call: the next call's start
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
        """The random state call ``index`` started from (0: the step's); ``owned``/``host``: the tree's, the host's."""
        if self.start is None:
            return None
        torch_state, cuda_state, streams = self.start
        if index > 0:
            torch_state, cuda_state = self.calls[index - 1].torch_after, self.calls[index - 1].cuda_after
        return StepStart(torch_state, cuda_state, streams if owned else None, self.host if host else None)


def cuda_state(device_type: str) -> Optional[Callable[[], Tensor]]:
    """The current CUDA generator's ``get_state`` where ``device_type`` is CUDA's; None elsewhere."""
    cuda = device_type == "cuda" and torch.cuda.is_available()
    return torch.cuda.default_generators[torch.cuda.current_device()].get_state if cuda else None


def batch_record(
    batch: Any, index: int, cuda: Optional[Callable[[], Tensor]], owned: list[Any], host: bool
) -> BatchCalls:
    """A batch's record as it starts: torch's random state (CUDA's, by ``cuda``), the ``owned`` streams', the host's."""
    start = (
        torch.default_generator.get_state(),
        cuda() if cuda is not None else None,
        capture(owned) if owned else None,
    )
    return BatchCalls(batch, start=start, index=index, host=capture(global_streams()[1:]) if host else None)


class OriginFinder:
    """Tell where a skipped update's non-finite values were born (see the module docstring).

    :meth:`attach` at fit start, :meth:`start_batch` / :meth:`add_loss` / :meth:`take_batch` around each training
    batch, :meth:`origin` on a skip (what recording costs: the Performance page).

    Example:
        >>> OriginFinder().origin(BatchCalls(batch=torch.tensor([float("nan")]))).to_dict()
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

    def attach(self, module: torch.nn.Module, forward_context: Callable[[], Any], accumulating: bool = False) -> None:
        """Record the calls of ``module``'s call frontier; replays run under ``forward_context`` (autocast).

        ``accumulating``: only an update's last micro-batch is recorded: a finite one cannot say "backward".
        """
        self.detach()
        if getattr(module, "_compiler_ctx", None) is not None:
            return  # compiled as a whole: a hook would be traced into its graph and change what it computes
        self._module, self._forward_context, self._accumulating = module, forward_context, accumulating
        device = getattr(module, "device", None)
        if not isinstance(device, torch.device):
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._device_type = device.type
        self._owned = reach(module).streams  # each batch starts them where the step does: a replay draws alike
        self._cuda_state = cuda_state(self._device_type)
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
        self._handles, self._current = [], None

    def start_batch(self, batch: Any, index: int = -1, host: bool = False) -> None:
        """Record this batch's calls from now on, and the random state it starts with (``host``: Python's, numpy's)."""
        self._current = batch_record(batch, index, self._cuda_state, self._owned, host)

    def add_loss(self, loss: Tensor) -> None:
        """A loss of this batch (a GAN backpropagates two), just before its backward.

        From here the calls' outputs are held weakly: one only the step held (the logits) is freed as without the
        finder.
        """
        current = self._current
        if current is None:
            return
        current.losses.append(loss)
        calls = current.calls
        for index in range(current.weak, len(calls)):
            call = calls[index]
            output = call.output  # a tensor inline: this runs once a call, every batch
            held = weakref.ref(output) if type(output) is Tensor else _Weak(map(weakref.ref, tensors(output)))
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

    def origin(self, record: Optional[BatchCalls] = None) -> Optional[Origin]:
        """Where ``record``'s (default: this batch's) inf/nan were born (:class:`~lightning_amp_plus.origin.Origin`).

        Read in order: the batch's inf/nan reaching a call (:attr:`Phase.INPUT`); inf/nan a call took in that no
        call made (:data:`OWN_CODE`); the first call whose finite inputs gave a non-finite
        output, replayed (:attr:`Phase.FORWARD`: the module, ``float32``, ``islands``; ``within`` and ``reason`` where
        the replay computed other values); the loss (:attr:`Phase.LOSS`); else :attr:`Phase.BACKWARD`. None: not told.
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
            if taken:  # made by the own code before this call; the batch holding that kind too is said (it may spread)
                kind = "inf" if "inf" in taken else "nan"
                return Origin(Phase.FORWARD, OWN_CODE, kind, batch_too=bool(taken & in_batch))
            if output is _GONE or nonfinite_kind(output) is not None:
                born = self._measured(record, index)
                if born is not None:  # else: finite, or only masks (-inf by design) left the call
                    return born
                by_design.update(map(id, tensors(output)))  # nothing where it was freed
        if any(nonfinite_kind(loss.detach()) is not None for loss in record.losses):
            # the batch holding inf/nan is said: it may have reached the loss (a target), not told apart
            return Origin(Phase.LOSS, batch_too=nonfinite_kind(record.batch) is not None)
        if self._accumulating:
            return None  # an earlier micro-batch of the update may have made them: not recorded
        return Origin(Phase.BACKWARD)

    def _measured(self, record: BatchCalls, index: int) -> Optional[Origin]:
        """The module inside call ``index`` that made its non-finite output, and the islands that fix it, by replay.

        Each module born in (inputs finite, output not) runs in float32 in the next replay: non-finite still, no
        precision avoids it (``-inf`` alone: a mask or a bias by design, no origin); finite, it stays an island, until
        nothing is born. ``()`` where more than :data:`MAX_ISLANDS` are needed, float32 does not fix another call's, or
        the own code passed something made of the calls replayed to a later call (what it makes there is not replayed).
        A module the call's float32 value reaches that is non-finite in float32 too is the origin, ``NONFINITE``.
        """
        calls, name = record.calls, record.calls[index].name
        chain, positions, unseen = _reached(record, index)
        islands: list[str] = []  # run in float32 in the next replay, in the order found
        first: dict[str, tuple[int, str, bool]] = {}  # module -> the call, kind and +inf/nan it was first born with
        design: set[str] = set()  # modules whose -inf float32 makes too
        contained = True
        for round in range(2 * MAX_ISLANDS + 4):
            replay = self._replay(record, positions, islands, design)
            ours = [m for m in islands if first[m][0] == index]
            if index in replay.errors:
                if not ours:
                    return unknown(f"the replay of {name} raised {replay.errors[index]}")
                return Origin(Phase.FORWARD, ours[0], first[ours[0]][1], Verdict.UNKNOWN)
            if round == 0:
                held = _alive(calls[index].output)
                if held is _GONE and nonfinite_kind(replay.outputs[index]) is None:
                    return None  # it made nothing non-finite (its output was freed: replayed to see)
                odd = [i for i in positions if i not in replay.errors and not replay.alike(calls[i], i)]
                if index in odd:
                    kind = nonfinite_kind(replay.outputs[index] if held is _GONE else held)
                    reason = f"nondeterministic: the replay of {name} computed other values than the step"
                    return Origin(Phase.FORWARD, within=name, kind=kind, reason=reason)
                contained = not odd
            contained = contained and not replay.errors
            tried = list(islands)
            born: dict[str, tuple[int, str, str, bool]] = {}
            for birth in replay.births:
                born.setdefault(birth[1], birth)  # a module's first birth in the replay
            for position, module, kind, real in born.values():
                if module not in islands:
                    islands.append(module)
                    first[module] = (position, kind, real)
                elif not (real or first[module][2]):
                    islands.remove(module)  # -inf alone, which float32 makes too: by design
                    design.add(module)
                elif ours and module == ours[0] or first[module][0] in chain:
                    # non-finite in float32 too, at the origin or where the call's float32 value flows
                    return self._nonfinite(record, index, module, first[module][1], positions, islands, design, unseen)
                else:
                    contained = False  # another call's, which float32 does not fix
            ours = [m for m in islands if first[m][0] == index]
            if not ours and not any(birth[0] == index for birth in replay.births):
                return None  # finite, or only masks (-inf by design) left the call
            if ours and ours[0] in tried and (not contained or not replay.births or len(islands) > MAX_ISLANDS):
                outputs = [replay.outputs.get(i) for i in chain]
                fixed = contained and not replay.births and len(islands) <= MAX_ISLANDS
                fixed = fixed and nonfinite_kind(outputs, masks=True) is None and not unseen
                found = (ours[0], *(m for m in islands if m != ours[0])) if fixed else ()
                return Origin(Phase.FORWARD, ours[0], first[ours[0]][1], Verdict.FINITE, islands=found)
        return unknown(f"the replays of {name} found no end")

    def _nonfinite(
        self,
        record: BatchCalls,
        index: int,
        module: str,
        kind: str,
        positions: list[int],
        islands: list[str],
        design: set[str],
        unseen: bool,
    ) -> Origin:
        """``module``, non-finite in float32 too, unless the calls that fed call ``index`` and it, in float32, end it.

        Then what their float16 outputs lost (a difference rounded away) is the cause, and they are islands too (not
        shown where the own code fed a later call: ``unseen``).
        """
        fed = _fed(record, index)  # and the call itself, whole: a module inside it may have fed this one
        wider = list(dict.fromkeys([module, *(record.calls[i].name for i in [*fed, index]), *islands]))
        if len(wider) > 1 and len(wider) <= MAX_ISLANDS and _replayable(record, [*fed, index]):
            replay = self._replay(record, [*fed, *positions], wider, design)
            outputs = [replay.outputs.get(i) for i in positions]
            if not replay.errors and not replay.births and nonfinite_kind(outputs, masks=True) is None:
                return Origin(Phase.FORWARD, module, kind, Verdict.FINITE, islands=() if unseen else tuple(wider))
        return Origin(Phase.FORWARD, module, kind, Verdict.NONFINITE)

    def _replay(self, record: BatchCalls, positions: list[int], islands: list[str], design: set[str]) -> _Replay:
        """The calls ``positions`` again, sandboxed, each from its own start, every module in them watched.

        A call takes what the replay returned where it took what was recorded; ``islands`` run in float32.
        """
        model = self._module
        assert model is not None
        calls = [record.calls[i] for i in positions]
        frontier = [(c.name, resolve_module(c.module)) for c in calls]  # a compiled module replays eagerly
        roots = (*(inner for _, inner in frontier), *((c.args, c.kwargs) for c in calls))  # what its code reaches
        owned = [stream for stream, _ in (record.start[2] or [])] if record.start is not None else []
        replay = _Replay(design)
        replaced: dict[int, Tensor] = {}
        try:
            with (
                sandboxed(roots, self._device_type, grad=True, streams=owned),
                no_logging(model),
                torch.enable_grad(),
                replay.watching(frontier, self._device_type, islands),
            ):
                for index, call, (_, module) in zip(positions, calls, frontier, strict=True):
                    start = record.step_start(index, owned=index == positions[0], host=False)
                    if start is not None:
                        start.restore()
                    given = map_tensors(lambda t: replaced.get(id(t), t), (call.args, call.kwargs))
                    replay.position, replay.open = index, []
                    with self._forward_context():
                        output, error = attempt(_called, module, given)
                    cuda = self._cuda_state() if self._cuda_state is not None else None
                    replay.after[index] = (torch.default_generator.get_state(), cuda)
                    replay.outputs[index] = output
                    if error is not None:
                        replay.errors[index] = error
                        continue
                    replaced.update(zip(map(id, tensors(_alive(call.output))), tensors(output), strict=False))
        except Exception as error:  # noqa: BLE001 - the sandbox refused or failed: told, never raised
            replay.errors.setdefault(positions[0], raised(error))
        return replay


def _reached(record: BatchCalls, index: int) -> tuple[list[int], list[int], bool]:
    """Call ``index``'s chain, the calls a replay of it covers, and whether the own code fed inf/nan to others.

    The chain: it and each later call that took in, as the very tensor, what one of it returned. Covered: the chain
    and each later call born in on its own, with its chain (an island fix must cover each). The own code feeding
    another later call may cast an island's float32 value back.
    """
    chain, replayed, unseen = [index], [index], False
    ours = {id(t) for t in tensors(_alive(record.calls[index].output))}
    made = set(ours)
    for later, call in enumerate(record.calls[index + 1 :], index + 1):
        took, output = {id(t) for t in tensors((call.args, call.kwargs))}, _alive(call.output)
        if took & ours:
            chain.append(later)
            ours.update(map(id, tensors(output)))
        alone = nonfinite_kind((call.args, call.kwargs)) is None and (output is _GONE or nonfinite_kind(output))
        if took & made or alone:
            replayed.append(later)
            made.update(map(id, tensors(output)))
        elif nonfinite_kind((call.args, call.kwargs), masks="inputs") is not None:
            unseen = True
    return chain, replayed, unseen


def _fed(record: BatchCalls, index: int) -> list[int]:
    """The earlier calls whose outputs call ``index`` took in as the very tensors, and those that fed them."""
    wanted = set(map(id, tensors((record.calls[index].args, record.calls[index].kwargs))))
    fed: list[int] = []
    for earlier in range(index - 1, -1, -1):
        call = record.calls[earlier]
        if wanted & set(map(id, tensors(_alive(call.output)))):
            fed.insert(0, earlier)
            wanted.update(map(id, tensors((call.args, call.kwargs))))
    return fed


def _replayable(record: BatchCalls, indices: list[int]) -> bool:
    """Whether every floating tensor the calls ``indices`` took is the batch's or one of their own outputs.

    Else the own code made it, maybe of a replayed call's output (``norm(h, h.mean())``): the replay would hand the
    call its recorded value beside the replayed ``h``, a pair the step never computed.
    """
    given = {id(t) for t in tensors(record.batch)}
    given.update(id(t) for i in indices for t in tensors(_alive(record.calls[i].output)))
    took = (t for i in indices for t in tensors((record.calls[i].args, record.calls[i].kwargs)))
    return all(id(t) in given for t in took if t.is_floating_point())


def _called(module: torch.nn.Module, given: tuple[Any, Any]) -> Any:
    return module(*copied_inputs(given[0]), **copied_inputs(given[1]))


class _Replay:
    """One replay: by call, its output, what it raised, torch's random state after; and the modules born in.

    Born in: inputs finite, output not, no module inside it so (a ``design`` module's ``-inf`` is none).
    """

    def __init__(self, design: set[str]) -> None:
        self.outputs: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.after: dict[int, tuple[Tensor, Optional[Tensor]]] = {}
        self.births: list[tuple[int, str, str, bool]] = []  # call, module, kind, +inf or nan
        self.position = -1  # the call replayed
        self.open: list[int] = []  # the births found when each module running started
        self._design = design
        self._names: dict[int, str] = {}

    def alike(self, call: Call, index: int) -> bool:
        """Whether it computed what the step did: the call's output, or (freed) the random state it left."""
        held = _alive(call.output)
        if held is not _GONE:
            return same_values(self.outputs[index], held)
        return same_values(self.after[index], (call.torch_after, call.cuda_after))

    @contextlib.contextmanager
    def watching(
        self, frontier: list[tuple[str, torch.nn.Module]], device_type: str, islands: list[str]
    ) -> Iterator[None]:
        """Every module inside ``frontier`` hooked; those in ``islands`` in float32 (the sandbox puts them back)."""
        handles: list[Any] = []
        for name, inner in frontier:
            for sub, module in inner.named_modules():
                if id(module) not in self._names:
                    self._names[id(module)] = clean_name(f"{name}.{sub}" if sub else name)
                    if self._names[id(module)] in islands and "forward" not in vars(module):
                        module.forward = fp32_forward(module.forward, device_type)  # type: ignore[method-assign]
                    handles.append(module.register_forward_pre_hook(lambda *_: self.open.append(len(self.births))))
                    handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

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
    """Whether the inf/nan a call took in can be the batch's.

    Yes for a batch tensor holding them (or a view of one), or when every sample (first dimension) holding them is one
    where the batch does; a tensor of another first dimension (flattened) cannot be compared: no.
    """
    bad = [t for t in values(batch) if t.is_floating_point() and nonfinite_kinds(t, True)]
    shared = {t.untyped_storage().data_ptr() for t in bad}
    if any(t.untyped_storage().data_ptr() in shared for t in values(took)):
        return True
    rows: dict[int, set[int]] = {}
    for t in bad:
        if t.dim():
            rows.setdefault(t.shape[0], set()).update(_bad_rows(t))
    told = [t for t in values(took) if t.is_floating_point() and t.dim() and nonfinite_kinds(t, True)]
    return bool(told) and all(t.shape[0] in rows and _bad_rows(t) <= rows[t.shape[0]] for t in told)


def _bad_rows(tensor: Tensor) -> set[int]:
    """The samples (first dimension) where ``tensor`` holds a non-finite value an additive mask does not explain."""
    inf, nan = _counted(tensor.detach(), True)
    return set((inf | nan).reshape(tensor.shape[0], -1).any(1).nonzero().flatten().tolist())


#: how much an origin tells, most first: a rank that saw the inf/nan born outranks one whose forward was finite
_TELLING = [Phase.INPUT, Phase.LOSS, Phase.FORWARD, Phase.BACKWARD, Phase.UNKNOWN]


def job_origin(per_rank: list[Optional[Origin]]) -> Optional[Origin]:
    """One skipped update's origin from every rank's: the most telling, with its ``rank`` (the others say backward).

    Example:
        >>> job_origin([Origin(Phase.BACKWARD), Origin(Phase.INPUT)]).to_dict()
        {'phase': 'input', 'rank': 1}
    """
    told = [(_TELLING.index(o.phase), rank, o) for rank, o in enumerate(per_rank) if o]
    if len(per_rank) == 1 or not told:
        return told[0][2] if told else None
    _, rank, origin = min(told, key=lambda found: found[:2])
    return origin.but(rank=rank)


def call_frontier(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules ``module``'s own code calls: its children, a container's (never called itself) in its place.

    Example:
        >>> from torch import nn
        >>> m = nn.Module()
        >>> m.layers, m.head = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]), nn.Linear(2, 1)
        >>> [name for name, _ in call_frontier(m)]
        ['layers.0', 'layers.1', 'head']
    """
    for name, child in module.named_children():
        # a container (`_forward_unimplemented`); a scripted module's class `forward` is scripted: called whole
        scripted = isinstance(child, torch.jit.ScriptModule)
        container = not scripted and type(child).forward is torch.nn.Module.forward and "forward" not in vars(child)
        if container and not is_compiled_wrapper(child):
            yield from call_frontier(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


def nonfinite_kind(value: Any, masks: Masks = False) -> Optional[str]:
    """``"inf"`` or ``"nan"`` for the first floating tensor in ``value`` (any container) holding one.

    With ``masks``, an additive mask's ``-inf`` does not count: a tensor whose finite values take two values at most
    (0 / ``-inf``; 0 / -1e4 / ``-inf``). ``masks="inputs"`` (what a call takes in): besides, ``-inf`` counts only in
    a half-precision tensor (float32's ``-inf`` is a mask or a bias by design). ``masks="all"``: no ``-inf`` counts.
    """
    for tensor in values(value):
        kinds = nonfinite_kinds(tensor, masks)
        if kinds:
            return "inf" if "inf" in kinds else "nan"
    return None


def nonfinite_kinds(value: Any, masks: Masks = False) -> set[str]:
    """Every kind (``"inf"``, ``"nan"``) the floating tensors in ``value`` hold, read as :func:`nonfinite_kind`."""
    counted = [_counted(t, masks) for t in values(value) if t.is_floating_point()]
    return {kind for pair in counted for kind, found in zip(("inf", "nan"), pair, strict=True) if bool(found.any())}


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


def same_values(replayed: Any, recorded: Any) -> bool:
    """Whether a replay computed what the step did: alike tensors, inf/nan in the same places, the rest equal.

    Floats to a relative 1e-3 (:func:`torch.testing.assert_close`): a GPU's sums are not bitwise repeatable.
    """
    try:
        for x, y in zip(values(replayed), values(recorded), strict=True):
            x, y = x.detach(), y.detach().to(x.device)
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-6, equal_nan=True)
            elif x.dtype != y.dtype or not torch.equal(x, y):
                return False
    except (AssertionError, ValueError):  # another value, dtype or shape; another number of tensors
        return False
    return True


def versions(args: Any, kwargs: Any, output: Any = None) -> list[int]:
    """How many version counters a call's arguments hold, then theirs, then its output's (-1: an inference tensor)."""
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


class _Weak(tuple[Any, ...]):
    """A call's output held weakly: its tensors (in :func:`tensors` order), each a weak reference."""


def _alive(held: Any) -> Any:
    """What a record holds: the output (its tensors, when held weakly), or :data:`_GONE` if the step freed one."""
    if isinstance(held, weakref.ref):
        held = held()
        return _GONE if held is None else held
    if isinstance(held, _Weak):
        found = [ref() for ref in held]
        return _GONE if any(t is None for t in found) else found
    return held
