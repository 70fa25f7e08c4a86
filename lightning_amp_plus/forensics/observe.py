"""Observe: what the step itself computed, read only when an update was skipped. Nothing of yours runs again.

The batch and the losses are held by reference until the batch ends. After the first skip whose loss was inf/nan,
a :class:`Watch` hooks every module: before and after each call, one device-side ``aminmax`` per floating tensor the
call takes in and gives out, kept in the batch's trace and read on the host only when its update was skipped
(:func:`read`: one transfer). ``+inf`` and NaN show in it. A ``-inf`` alone is a mask or a bias by design; one in
half precision beside values other than 0 counts where a later call turns it into ``+inf`` or NaN
(:func:`~.verdict.first_born`), and in the batch where it is no mask.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor
from torch.nn.modules import module as _torch_module

from lightning_amp_plus.forensics._modules import How, walk
from lightning_amp_plus.forensics._tree import dispatches_to_torch, tensors, torch_only, values

#: which ``-inf`` counts (see :func:`nonfinite_kinds`): every one (False), all but an additive mask's (True)
Masks = Union[bool, Literal["all"]]
#: a trace's event: a module's index (>= 0: a call starts, its inputs; < 0: ``~index``'s call ends, its output) and,
#: per floating tensor, whether half precision, its ``aminmax`` (per sample, with its storage, where the step itself
#: hands it to a module)
Event = tuple[Any, ...]
_PLAIN = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)
_HALF = (torch.float16, torch.bfloat16)


class BatchRecord:
    """One training batch as observed: the batch and its ``losses`` by reference, and what was kept of it.

    ``trace``: the watch's events (None: not watched); ``calls``: the recorded module calls (replay only);
    ``start``: the random streams' states as it started (where a rerun of its step may need them), ``loaded`` a copy
    of the batch then (a rerun starts from it); ``versions``: the batch's own tensors (top level) with their version
    counters as it started.
    """

    __slots__ = ("batch", "calls", "index", "loaded", "losses", "start", "trace", "unread", "versions")

    def __init__(self, batch: Any, index: int = -1, losses: Optional[list[Tensor]] = None, start: Any = None) -> None:
        self.batch, self.index, self.losses = batch, index, losses if losses is not None else []
        self.trace: Optional[list[Event]] = None
        #: the first watched call of it left unread, and why (:attr:`Watch.unread`)
        self.unread: Optional[str] = None
        self.calls: Optional[list[Any]] = None
        self.start: Optional[list[tuple[Any, Any]]] = start  # (random stream, state): the opt-in sandbox's
        self.loaded: Any = None
        #: read as its step starts (:meth:`~.finder.OriginFinder.step_starting`)
        self.versions: Optional[list[tuple[Tensor, int]]] = None

    def changed(self) -> list[Tensor]:
        """The batch's tensors the step changed in place (``x.sub_(mean)``): they no longer hold what was loaded.

        Views of one storage share a version counter: a change to one cannot be told apart, so none of them counts.
        """
        with torch_only():
            kept = self.versions or []
            storages = [t.untyped_storage().data_ptr() for t, _ in kept]
            return [
                t
                for (t, version), at in zip(kept, storages, strict=True)
                if t._version != version and storages.count(at) == 1
            ]

    def as_loaded(self) -> tuple[Any, list[Tensor]]:
        """The batch as loaded, where it can be told, and the tensors it cannot tell (changed, and no copy kept).

        A tensor the step changed in place is its copy from :attr:`loaded` (kept with reruns), else None.
        """
        changed = {id(t) for t in self.changed()}
        if not changed:
            return self.batch, []
        if isinstance(self.batch, Tensor):
            return self.loaded, [] if self.loaded is not None else [self.batch]
        given, copies = _top(self.batch), _top(self.loaded) if self.loaded is not None else None
        made = {k: (copies[k] if copies is not None else None) if id(v) in changed else v for k, v in given.items()}
        unknown = [v for v in given.values() if id(v) in changed] if copies is None else []
        return (made if isinstance(self.batch, dict) else list(made.values())), unknown


def _top(batch: Any) -> dict[Any, Any]:
    """A batch's top-level items by key (a dict's) or position, read by the built-in type's own methods."""
    if isinstance(batch, dict):
        return dict(dict.items(batch))
    return dict(enumerate((tuple if isinstance(batch, tuple) else list).__iter__(batch)))


def nonfinite_kinds(value: Any, masks: Masks = False, minus: bool = False) -> set[str]:
    """Every kind (``"inf"``, ``"nan"``) the floating tensors in ``value`` (any container) hold.

    With ``masks``, an additive mask's ``-inf`` does not count: a tensor whose finite values take two values at most
    (0 / ``-inf``; 0 / -1e4 / ``-inf``). ``masks="all"``: no ``-inf`` counts. ``minus``: one that counts adds
    ``"-inf"`` too.
    """
    found: set[str] = set()
    with torch_only():
        for tensor in values(value):
            if tensor.is_floating_point() and tensor.numel() and dispatches_to_torch(tensor):
                t = tensor.detach()
                found.update(("nan",) if bool(torch.isnan(t).any()) else ())
                found.update(("inf",) if bool(torch.isposinf(t).any()) else ())
                if masks != "all" and bool(torch.isneginf(t).any()) and not (masks and _mask_like(t)):
                    found.update(("inf", "-inf") if minus else ("inf",))
    return found


def nonfinite_kind(value: Any, masks: Masks = False) -> Optional[str]:
    """``"inf"`` or ``"nan"`` if ``value`` holds one (inf first), else None."""
    kinds = nonfinite_kinds(value, masks)
    return "inf" if "inf" in kinds else "nan" if kinds else None


def _mask_like(tensor: Tensor) -> bool:
    """Whether ``tensor``'s ``-inf`` is an additive mask's: its finite values (if any) two values at most."""
    finite = tensor[torch.isfinite(tensor)]
    return not finite.numel() or bool(((finite == finite.min()) | (finite == finite.max())).all())


#: the step's own inputs are read per sample only this far (a batch's rows); beyond, as one tensor
_ROWS = 1024


def _unreadable(t: Tensor) -> Optional[str]:
    """Why the watch cannot read floating tensor ``t`` with torch's own kernels; None where it can."""
    if t.is_nested:
        return "a nested tensor"
    if t.layout is not torch.strided:
        return f"a {str(t.layout).replace('torch.', '')} tensor"
    if t.is_meta:
        return "a meta tensor"
    if _functorch_wrapped(t):
        return "a tensor inside torch.func (vmap, grad)"
    if not (type(t) is Tensor or dispatches_to_torch(t)):
        return f"a {type(t).__name__} (its own __torch_dispatch__)"
    return None


#: whether a tensor is torch.func's (vmap's, grad's) wrapper: torch's own test, where this torch has it
_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


#: what a watch keeps of a tensor it read this batch: the tensor (weakly), its version, what was read
Read = dict[int, tuple[Any, int, tuple[Any, ...]]]


def _extremes(
    value: Any,
    kwargs: Any = None,
    top: bool = False,
    rows: Optional[set[int]] = None,
    read: Optional[Read] = None,
    nodes: bool = False,
) -> tuple[list[tuple[Any, ...]], Optional[str]]:
    """A call's ``value`` (and ``kwargs``) as an :data:`Event` keeps them, on the device; why one was left unread.

    The reason is None where every floating tensor was read. Called under ``no_grad`` and ``torch_only`` (only
    torch's own code runs: no ``__torch_function__``, a subclass's or a mode's). A tensor torch's kernels cannot
    reduce as it is (:func:`_unreadable`) is left out. ``top``: the step's own inputs, read per sample where their
    first dimension is one of the batch's ``rows`` (at most :data:`_ROWS`; none: read whole, with their storage).
    ``read``: the tensors read before in this batch; one met again unchanged (a call's output the next call takes)
    gives what was read then, with no op; each tensor read whole is added. ``nodes`` (a call's output): each entry
    ends with its tensor's autograd node, by its sequence number (None: no graph): whether the loss used it.
    """
    found: list[tuple[Any, ...]] = []
    unread: Optional[str] = None
    nodes = nodes and SEQUENCED
    items = value if type(value) is tuple else (value,)  # a call's arguments, or the one value it returned
    if kwargs:
        items = (*items, *kwargs.values())
    # the hot path (issue 51): each line here runs once a tensor a watched call; one dict lookup for the read-once
    # cache (never an inference tensor: no version counter tells a change in place)
    for item in items:
        kind = type(item)
        if kind is Tensor:
            leaves: Any = (item,)
        elif kind in _FLAT:  # (h, c): no walk where it holds tensors only (a loop: no generator a call)
            leaves = item
            for x in item:
                if type(x) is not Tensor:
                    leaves = tensors(item)
                    break
        elif isinstance(item, _PLAIN):
            continue
        else:
            leaves = tensors(item)
        for t in leaves:
            if not t.is_floating_point():
                continue
            if type(t) is not Tensor or t.is_nested or t.is_meta or t.layout is not _STRIDED or _functorch_wrapped(t):
                why = _unreadable(t)
                if why is not None:
                    unread = unread or why
                    continue
            sampled = top and rows and t.dim() > 0 and t.shape[0] in rows
            hit = read.get(id(t)) if read is not None and not sampled else None
            if hit is not None and hit[0]() is t and t._version == hit[1]:
                entry = hit[2]  # read before in this batch, unchanged since: no op
            elif not t.numel():
                continue
            elif sampled:
                # per sample, to tell the batch's (:func:`~.verdict._from_batch`); reduced where it lies
                # (a broadcast mask is not copied)
                n = t.shape[0]
                low_high = (
                    torch.aminmax(t.view(n, -1), dim=1)
                    if t.is_contiguous()
                    else (t.amin(tuple(range(1, t.dim()))), t.amax(tuple(range(1, t.dim()))))
                    if t.dim() > 1
                    else torch.aminmax(t.reshape(-1, 1), dim=1)
                )
                found.append((t.dtype in _HALF, low_high, t.untyped_storage().data_ptr()))
                continue
            else:
                entry = (t.dtype in _HALF, torch.aminmax(t))
                # an inference tensor has no version counter (`inference_mode` changes it in place unseen): read again
                if read is not None and not t.is_inference():
                    read[id(t)] = (weakref.ref(t), t._version, entry)
            if top:  # the step's own: its storage tells a batch tensor
                found.append((*entry, t.untyped_storage().data_ptr()))
            elif nodes:  # an output's: with its autograd node (inline: no call a tensor)
                node = t.grad_fn
                found.append((*entry, None if node is None else node._sequence_nr()))
            else:
                found.append(entry)
    return found, unread


_FLAT = (tuple, list)
_STRIDED = torch.strided
_grad_on, _set_grad = torch._C.is_grad_enabled, torch._C._set_grad_enabled

#: whether this torch's autograd nodes tell their sequence number (an output's node: whether the loss used it)
SEQUENCED = hasattr((torch.ones(1, requires_grad=True) * 2).grad_fn, "_sequence_nr")


def batch_rows(batch: Any) -> set[int]:
    """The first dimensions of the batch's own tensors, up to :data:`_ROWS`: where a step's input is read per sample."""
    with torch_only():
        return {t.shape[0] for t in tensors(batch) if not t.is_nested and t.dim() and t.shape[0] <= _ROWS}


#: a module the watch has not indexed yet
_NEW: Any = object()

#: the longest ``reason`` an unread call gives
_REASON = 200


class Watch:
    """Every call of a model's modules, watched: per call, the extremes of what it took in and gave out.

    The hooks are torch's global module hooks (as torch's ``ModuleTracker``): nothing is stored on your modules, so
    scripting, tracing, copying and saving them is as without the watch. A call counts when its module is in the
    model as it is now: a module added or replaced is found at its first call. :meth:`begin` starts a :attr:`trace` the
    hooks append :data:`Event` s to (None: they keep nothing). A call's inputs are read as it ends, as the module
    received them (after your pre-hooks), its output as it returns (your forward hooks act after: a value a later call
    does not take does not count, see :func:`~.verdict.first_born`). A compiled submodule is watched as one module,
    from outside; a scripted one is not watched (:attr:`unwatched` says so). A call the watch cannot read (a nested or
    meta tensor, inside ``torch.func``) is left out of that call's reading alone, and :attr:`unread` says which; a
    hook that fails does the same. It never raises into the step, and never stops.
    """

    def __init__(self) -> None:
        self.trace: Optional[list[Event]] = None
        self.on = False
        self.names: list[str] = []
        self.unwatched: list[str] = []
        #: the torch loss modules watched (``nn.CrossEntropyLoss()`` held as ``self.criterion``): what they make is the
        #: loss's
        self.loss_modules: set[str] = set()
        #: the modules compiled in place (``module.compile()``), by the watched module that calls them ("": the step)
        self.hidden: dict[str, list[str]] = {}
        #: the first call of this batch left unread, and why (at most 200 characters)
        self.unread: Optional[str] = None
        self.rows: Optional[set[int]] = None  # the batch's first dimensions (its own inputs, read per sample)
        self._index: dict[int, Optional[int]] = {}  # id(module) -> its index in names; None: seen, not watched
        self._kept: list[torch.nn.Module] = []  # the modules indexed, held: their ids stay theirs
        self._outside: dict[int, Any] = {}  # id -> weak reference: modules called that are not the model's
        #: calls in progress: event position, index, whether the step's own code called it, the rows read per sample,
        #: its inputs as read at its start (None: read as it ends)
        self._open: list[tuple[int, int, bool, Optional[set[int]], Any]] = []
        self._read: Read = {}  # the tensors read this batch
        self._returned = False  # a call the step's own code made returned in this batch
        self._walked = 0  # the model's walks this batch (a module not seen before was called)
        self._thread = 0
        self._model: Optional[torch.nn.Module] = None
        self._quiet: Optional[tuple[Any, ...]] = None

    @property
    def depth(self) -> int:
        """Calls in progress: 0 is the step's own code."""
        return len(self._open)

    def begin(self, rows: Optional[set[int]] = None) -> list[Event]:
        """A new trace, written from now on (by this thread); ``rows``: the batch's first dimensions."""
        self.trace, self._open, self.unread, self.rows, self._walked = [], [], None, rows, 0
        self._read, self._returned = {}, False
        self._thread = threading.get_ident()
        return self.trace

    def install(self, model: torch.nn.Module) -> None:
        """Watch every module under ``model`` (not ``model`` itself: its own code is the step's)."""
        self.remove()
        self._model = model
        self._walk()
        _dispatch(self, on=True)
        # torch warns of global hooks at each call of a compiled module (the watch's, not yours)
        warnings.filterwarnings("ignore", message=_COMPILED_WARNING)
        self._quiet = warnings.filters[0]
        self.on = True

    def remove(self) -> None:
        """Take the hooks off; keep nothing more."""
        _dispatch(self, on=False)
        if self._quiet is not None and self._quiet in warnings.filters:
            warnings.filters.remove(self._quiet)  # type: ignore[attr-defined]
            warnings._filters_mutated()  # type: ignore[attr-defined]
        self.names, self.unwatched, self.trace, self.on = [], [], None, False
        self.hidden, self.loss_modules = {}, set()
        self._index, self._kept, self._outside, self._open, self._model, self._quiet = {}, [], {}, [], None, None
        self._read = {}
        self.unread = None

    def _walk(self) -> None:
        """Index the model's modules as they are now; a module indexed before keeps its index."""
        model = self._model
        if model is None:
            return
        index: dict[int, Optional[int]] = {id(model): None}
        kept = [model]
        for name, module, kind in walk(model):
            key = id(module)
            if key in index:
                continue
            kept.append(module)
            if kind is How.INSIDE:  # run inside a compiled graph or a script: no Python hook sees it
                index[key] = None
                continue
            if kind is How.COMPILED:  # its inner modules run inside its graph: watched as a whole
                self._say_once(f"{name} (compiled: watched as a whole)")
            elif kind is How.SCRIPTED:
                index[key] = None
                self._say_once(f"{name} (scripted)")
                continue
            elif kind is How.IN_PLACE:  # `module.compile()`: its hooks are traced
                self._say_once(f"{name} (compiled in place: watched from its caller)")
                caller = max((n for n in self.names if name.startswith(n + ".")), key=len, default="")
                hidden = self.hidden.setdefault(caller, [])
                hidden += [] if name in hidden else [name]
            old = self._index.get(key)
            if old is None:
                self.names.append(name)
                old = len(self.names) - 1
            if isinstance(module, torch.nn.modules.loss._Loss):  # a loss function held as a module
                self.loss_modules.add(name)
            index[key] = old
        self._index, self._kept = index, kept
        for key in [k for k in self._outside if k in index]:
            del self._outside[key]

    @contextlib.contextmanager
    def apart(self) -> Iterator[list[Event]]:
        """A trace of its own while inside (a replay), the batch's put back after."""
        saved = self.trace, self._open, self.unread, self.rows, self._walked, self._thread, self._read, self._returned
        try:
            yield self.begin()
        finally:
            (self.trace, self._open, self.unread, self.rows, self._walked, self._thread, self._read, self._returned) = (
                saved
            )

    def _say_once(self, what: str) -> None:
        if what not in self.unwatched:
            self.unwatched.append(what)

    def _known(self, module: torch.nn.Module) -> Optional[int]:
        """``module``'s index: a module not indexed yet walks the model again (once a batch), else it is outside."""
        key = id(module)
        if key in self._index:
            return self._index[key]
        ref = self._outside.get(key)
        if (ref is not None and ref() is module) or self._walked >= _WALKS:
            return None
        self._walked += 1
        self._walk()
        if key in self._index:
            return self._index[key]
        self._outside[key] = weakref.ref(module)
        return None

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        trace = self.trace
        if trace is None or torch._C._get_tracing_state() is not None:  # not watching, or `torch.jit.trace`
            return
        index = self._index.get(id(module), _NEW)
        if index is _NEW:
            try:
                index = self._known(module)
            except Exception:  # noqa: BLE001 - a watch never raises into the step
                index = None
        if index is None:
            return
        if threading.get_ident() != self._thread:  # another thread's call: said, not read
            self.unread = self.unread or f"{self.names[index]} was called from another thread, unread"[:_REASON]
            return
        top = not self._open  # the step's own inputs: per sample until a call of the step's returned (after, they
        # can be what a module made)
        rows = self.rows if top and not self._returned else None
        took: Any = None  # read as the call ends where the module has pre-hooks of yours (read after they acted)
        if not (module._forward_pre_hooks and any(_yours(hook) for hook in module._forward_pre_hooks.values())):
            took = self._read_safely(index, args, None, top, rows)
        self._open.append((len(trace), index, top, rows, took))
        trace.append((index, []))

    def _after(self, module: torch.nn.Module, args: Any, *rest: Any) -> None:
        trace, opened = self.trace, self._open
        if trace is None or not opened or threading.get_ident() != self._thread:
            return
        position, index, top, rows, took = opened[-1]
        if self._index.get(id(module)) != index:  # a call not watched (its start was not)
            return
        opened.pop()
        output, kwargs = rest[-1], rest[0] if len(rest) == 2 else None  # an exception: no kwargs
        if took is None:
            took = self._read_safely(index, args, kwargs, top, rows)
        elif kwargs:  # keyword arguments reach the after-hook only: read as the call ends
            took = took + self._read_safely(index, (), kwargs, top, rows)
        self._returned = self._returned or top
        # a module with forward hooks of yours (its own, or global ones after the watch's): its output was read
        # before they acted (see `verdict.first_born`), and is not kept for a later call to reuse
        hooked = bool(module._forward_hooks) and any(_yours(hook) for hook in module._forward_hooks.values())
        hooked = hooked or (len(_GLOBAL_AFTER) > 1 and _hooked_after_us())
        gave = self._read_safely(index, (output,), None, False, None, keep=not hooked, nodes=True)
        trace[position] = (index, took)
        trace.append((~index, gave, True) if hooked else (~index, gave))

    def _read_safely(
        self,
        index: int,
        args: Any,
        kwargs: Any,
        top: bool,
        rows: Optional[set[int]],
        keep: bool = True,
        nodes: bool = False,
    ) -> list[tuple[Any, ...]]:
        """:func:`_extremes` of a call's ``args``/``kwargs`` (no graph, torch's code only); never raises."""
        try:
            with torch_only():  # a mode the step runs under sees none of this
                grad = _grad_on()
                if grad:
                    _set_grad(False)  # no graph: no detach a tensor
                try:
                    found, why = _extremes(args, kwargs, top, rows, self._read if keep else None, nodes)
                finally:
                    if grad:
                        _set_grad(True)
        except Exception as error:  # noqa: BLE001 - a watch never raises into the step
            found, why = [], f"what a watch hook raised ({type(error).__name__})"
        if why is not None and self.unread is None:
            self.unread = f"{self.names[index]} took or gave {why}, unread"[:_REASON]
        return found


#: how often a batch walks the model again for modules not seen before (each new object at most once)
_WALKS = 8

#: torch's table of global forward hooks (read, never kept from: the watch's own entry is put and taken there)
_GLOBAL_AFTER = _torch_module._global_forward_hooks

#: the watches on (one a fit); torch's global hooks dispatch to them under fixed keys, so a compiled graph's guard on
#: the global hooks holds from one fit to the next (no recompile)
_WATCHES: list[Watch] = []
_KEYS: list[int] = []
_FLAG_TABLES = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def _dispatch(watch: Watch, on: bool) -> None:
    """Put ``watch`` on or off torch's global module hooks (the two dispatchers, registered while any is on)."""
    from torch.nn.modules import module as torch_module
    from torch.utils.hooks import RemovableHandle

    if on and watch not in _WATCHES:
        _WATCHES.append(watch)
    elif not on and watch in _WATCHES:
        _WATCHES.remove(watch)
    if not _KEYS:  # once a process: the ids torch's global hook tables hold the dispatchers under
        _KEYS.extend(RemovableHandle(torch_module._global_forward_pre_hooks).id for _ in range(2))
    before, after = _KEYS
    # keywords and always-called global hooks: tables a torch without them lacks (then: neither)
    flags = [getattr(torch_module, name, None) for name in _FLAG_TABLES]
    if _WATCHES:
        torch_module._global_forward_pre_hooks[before] = _before
        torch_module._global_forward_hooks[after] = _after
        for table in flags:
            if table is not None:
                table[after] = True
    else:
        torch_module._global_forward_pre_hooks.pop(before, None)
        for table in (torch_module._global_forward_hooks, *flags):
            if table is not None:
                table.pop(after, None)


def _before(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # traced into a compiled graph: nothing there (no op, no graph break)
        return
    for watch in _WATCHES:
        watch._before(module, args)


def _after(module: torch.nn.Module, args: Any, *rest: Any) -> None:
    if torch.compiler.is_compiling():
        return
    for watch in _WATCHES:
        watch._after(module, args, *rest)


def _hooked_after_us() -> bool:
    """Whether a global forward hook of yours runs after the watch's (it acts on outputs the watch read first)."""
    return len(_GLOBAL_AFTER) > 1 and next(reversed(_GLOBAL_AFTER)) != _KEYS[1]


def _yours(hook: Any) -> bool:
    """Whether a module's forward hook is not this package's (the replay's recorder, the precision report's)."""
    return not str(getattr(hook, "__module__", "")).startswith("lightning_amp_plus.")


#: the warning torch gives at each call of a compiled module while any global module hook is on
_COMPILED_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def _kind(low: float, high: float, half: bool) -> Optional[str]:
    """A tensor's kind from its extremes: ``"nan"``, ``"inf"`` (``+inf``), ``"-inf16"`` or ``"-inf"``; None.

    ``"-inf16"``: a half-precision ``-inf`` beside values other than 0 (an overflow, or a mask or a bias made in half
    precision). ``"-inf"``: any other (a mask or a bias by design).
    """
    if high != high:
        return "nan"
    if high == float("inf"):
        return "inf"
    if low == float("-inf"):
        return "-inf16" if half and high != 0 else "-inf"
    return None


#: an event's kind: the first its tensors hold, in this order
_ORDER = ("inf", "nan", "-inf16", "-inf")


def read(trace: list[Event]) -> list[tuple[Any, ...]]:
    """Each event's module index, kind (``"inf"`` first), storages and samples, hooked, and its bad nodes.

    Storages and samples: the step's own inputs'. Hooked: an output read before your forward hooks acted. Bad nodes:
    the autograd nodes of an output's tensors that hold +inf/NaN (where its kind is ``"-inf"``, a float32 one: those
    that hold it). One transfer to the host.
    """
    with torch_only():  # a mode the step runs under is not called
        flat = [torch.stack([m.float().flatten() for m in entry[1]]) for _, entries, *_ in trace for entry in entries]
        numbers = iter(torch.cat([m.to(flat[0].device) for m in flat], dim=1).tolist() if flat else [[], []])
    low, high = next(numbers), next(numbers)
    events: list[tuple[Any, ...]] = []
    at = 0
    for index, entries, *hooked in trace:  # hooked: (True,) where read before your forward hooks acted
        kinds: list[Optional[str]] = []
        tops: list[tuple[Any, list[Optional[str]]]] = []
        bad: list[Optional[int]] = []  # an output's tensors holding +inf/NaN: their autograd nodes (None: no graph)
        minus: list[Optional[int]] = []  # those holding a float32 -inf
        for half, extremes, *more in entries:  # more: a step input's storage, or an output's node
            n = extremes[0].numel()
            samples = [_kind(a, b, half) for a, b in zip(low[at : at + n], high[at : at + n], strict=True)]
            at += n
            kind = next((k for k in _ORDER if k in samples), None)
            kinds.append(kind)
            if index < 0:
                if kind in ("inf", "nan"):
                    bad.append(more[0] if more else None)
                elif kind == "-inf":
                    minus.append(more[0] if more else None)
            elif more:
                tops.append((more[0], samples))
        kind = next((k for k in _ORDER if k in kinds), None)
        # an output holding a float32 -inf alone: its nodes (where it was made: a log of 0)
        events.append((index, kind, tops, bool(hooked), tuple(minus if kind == "-inf" else bad)))
    return events
