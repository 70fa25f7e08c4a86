"""Observe: what the step itself computed, read only when an update was skipped. Nothing of yours runs again.

The batch and the losses are held by reference until the batch ends. After the first skip whose loss was inf/nan,
a :class:`Watch` hooks every module: before and after each call, one device-side ``aminmax`` per floating tensor the
call takes in and gives out, kept in the batch's trace and read on the host only when its update was skipped
(:func:`read`: one transfer). ``+inf`` and NaN show in it. A ``-inf`` alone is a mask or a bias by design; one in
half precision beside values other than 0 counts where a later call turns it into ``+inf`` or NaN
(:func:`~.verdict.first_born`), and in the batch where it is no mask.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper
from lightning_amp_plus.forensics._tree import dispatches_to_torch, tensors, torch_only, values
from lightning_amp_plus.forensics.sandbox import States

#: which ``-inf`` counts (see :func:`nonfinite_kinds`): every one (False), all but an additive mask's (True)
Masks = Union[bool, Literal["all"]]
#: a trace's event: a module's index (>= 0: a call starts, its inputs; < 0: ``~index``'s call ends, its output) and,
#: per floating tensor, whether half precision, its ``aminmax`` (per sample, with its storage, where the step itself
#: hands it to a module)
Event = tuple[int, list[tuple[Any, ...]]]
_PLAIN = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)
_HALF = (torch.float16, torch.bfloat16)


class BatchRecord:
    """One training batch as observed: the batch and its ``losses`` by reference, and what was kept of it.

    ``trace``: the watch's events (None: not watched); ``calls``: the recorded module calls (replay only);
    ``start``: the random streams' states as it started (where a rerun of its step may need them), ``loaded`` a copy
    of the batch then (a rerun starts from it); ``versions``: the batch's own tensors (top level) with their version
    counters as it started.
    """

    __slots__ = ("batch", "calls", "index", "loaded", "losses", "start", "trace", "versions")

    def __init__(self, batch: Any, index: int = -1, losses: Optional[list[Tensor]] = None, start: Any = None) -> None:
        self.batch, self.index, self.losses = batch, index, losses if losses is not None else []
        self.trace: Optional[list[Event]] = None
        self.calls: Optional[list[Any]] = None
        self.start: Optional[States] = start
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


def _extremes(value: Any, kwargs: Any = None, top: bool = False) -> list[tuple[Any, ...]]:
    """A call's ``value`` (and ``kwargs``) as an :data:`Event` keeps them, on the device, not read.

    Only torch's own code runs: no ``__torch_function__`` (a subclass's, a mode's); a tensor whose type dispatches
    to code of its own (``__torch_dispatch__``) is not read.
    """
    found: list[tuple[Any, ...]] = []
    items = value if type(value) is tuple else (value,)  # a call's arguments, or the one value it returned
    with torch_only():
        for item in (*items, *kwargs.values()) if kwargs else items:
            for t in (item,) if type(item) is Tensor else () if isinstance(item, _PLAIN) else tensors(item):
                if (
                    t.is_floating_point()
                    and t.numel()
                    and t.layout is torch.strided
                    and (type(t) is Tensor or dispatches_to_torch(t))
                ):
                    d = t.detach()
                    if not top or not d.dim():
                        found.append((d.dtype in _HALF, torch.aminmax(d)))
                        continue
                    # per sample, to tell the batch's (:func:`~.verdict._from_batch`); reduced where it lies (a
                    # broadcast mask is not copied)
                    dims = tuple(range(1, d.dim()))
                    low_high = (d.amin(dims), d.amax(dims)) if dims else torch.aminmax(d.reshape(-1, 1), dim=1)
                    found.append((d.dtype in _HALF, low_high, d.untyped_storage().data_ptr()))
    return found


class Watch:
    """Hooks on every module of a model that keep, per call, the extremes of what it took in and gave out.

    :meth:`begin` starts a :attr:`trace` the hooks append :data:`Event` s to (None: they keep nothing). A compiled
    submodule is watched from outside only (an inf/nan born inside it is named at it); a scripted one is not watched:
    :attr:`unwatched` says so. A hook that fails stops the watch (:attr:`failed`), never the step.
    """

    def __init__(self) -> None:
        self.trace: Optional[list[Event]] = None
        self.on = False
        self.depth = 0  # calls in progress: 0 is the step's own code
        self.names: list[str] = []
        self.unwatched: list[str] = []
        self.failed: Optional[str] = None
        self._handles: list[Any] = []

    def begin(self) -> list[Event]:
        """A new trace, written from now on."""
        self.trace, self.depth = [], 0
        return self.trace

    def install(self, model: torch.nn.Module) -> None:
        """Hook every module under ``model`` (not ``model`` itself: its own code is the step's)."""
        self.remove()
        inside: set[int] = set()
        for raw, module in model.named_modules():
            if not raw or id(module) in inside:
                continue
            if is_compiled_wrapper(module):  # a hook inside its graph would be traced: watched from outside only
                inside.update(id(m) for m in module._orig_mod.modules())  # type: ignore[operator]
                self.unwatched.append(f"{clean_name(raw)} (compiled: watched as a whole)")
            elif isinstance(module, torch.jit.ScriptModule):
                inside.update(id(m) for m in module.modules())
                self.unwatched.append(f"{clean_name(raw)} (scripted)")
                continue
            self.names.append(clean_name(raw))
            self._handles += [
                module.register_forward_pre_hook(_Before(self, len(self.names) - 1), with_kwargs=True),
                # always: a call that raises (a caught fallback, checkpointing's recompute stopped early) ends too
                module.register_forward_hook(_After(self, -len(self.names)), with_kwargs=True, always_call=True),
            ]
        self.on = True

    def remove(self) -> None:
        """Take every hook off; keep nothing more."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.names, self.unwatched, self.trace, self.on = [], [], [], None, False


class _Hook:
    """A watch hook, for the module at ``index`` of ``watch``.

    A copy of the model (``copy.deepcopy``, ``torch.save``) gets an inert one instead (:class:`_Gone`): the copy is
    not watched, and it pickles.
    """

    __slots__ = ("watch", "index")

    def __init__(self, watch: Watch, index: int) -> None:
        self.watch, self.index = watch, index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Gone, ())


class _Before(_Hook):
    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        watch = self.watch
        if watch.trace is not None:
            try:
                watch.trace.append((self.index, _extremes(args, kwargs, top=not watch.depth)))
                watch.depth += 1
            except Exception as error:  # noqa: BLE001 - a watch never raises into the step
                watch.failed, watch.trace = f"a watch hook raised {type(error).__name__}: {error}", None


class _After(_Hook):
    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        watch = self.watch
        if watch.trace is not None:
            try:
                watch.depth -= 1
                watch.trace.append((self.index, _extremes(output)))
            except Exception as error:  # noqa: BLE001
                watch.failed, watch.trace = f"a watch hook raised {type(error).__name__}: {error}", None


#: a module's per-hook flags (``always_called`` from torch 2.1)
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class _Gone:
    """A copied watch hook: it does nothing, and takes itself off the module at its first call."""

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [key for key, hook in hooks.items() if hook is self]:
                del hooks[key]
                for flags in _HOOK_FLAGS:
                    getattr(module, flags, {}).pop(key, None)


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


def read(trace: list[Event]) -> list[tuple[int, Optional[str], list[tuple[Any, list[Optional[str]]]]]]:
    """Each event's module index, its kind (``"inf"`` first) and, for the step's own inputs, storages and samples.

    One transfer to the host.
    """
    with torch_only():  # a mode the step runs under is not called
        flat = [torch.stack([m.float().flatten() for m in entry[1]]) for _, entries in trace for entry in entries]
        numbers = iter(torch.cat([m.to(flat[0].device) for m in flat], dim=1).tolist() if flat else [[], []])
    low, high = next(numbers), next(numbers)
    events: list[tuple[int, Optional[str], list[tuple[Any, list[Optional[str]]]]]] = []
    at = 0
    for index, entries in trace:
        kinds: list[Optional[str]] = []
        tops: list[tuple[Any, list[Optional[str]]]] = []
        for half, extremes, *storage in entries:
            n = extremes[0].numel()
            samples = [_kind(a, b, half) for a, b in zip(low[at : at + n], high[at : at + n], strict=True)]
            at += n
            kinds.append(next((k for k in _ORDER if k in samples), None))
            if storage:
                tops.append((storage[0], samples))
        events.append((index, next((k for k in _ORDER if k in kinds), None), tops))
    return events
