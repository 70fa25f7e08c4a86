"""OriginFinder: where a skipped update's inf/nan were born, told by replaying the batch's calls on a skip.

One component that :class:`~lightning_amp_plus.NaNSkipReporter` holds (and, through it, ``AmpAdvisor``): it keeps,
by reference, the calls of the modules the LightningModule calls (its children; the children of a container such
as ``nn.ModuleList``, which is never called itself), and on a skipped update replays them eagerly under autocast
with every module hooked, without grad. Only the modules run again, never ``training_step``: code there (an EMA
update, weight clamping, a gradient penalty, a write to a file) runs once. The replay leaves the model as it found
it: the random-number state (global and a module's own ``torch.Generator``), every buffer (in place or assigned),
every attribute a module assigns. The first module whose inputs were finite and whose output was not is recomputed
in float32: an fp16 overflow is finite there, a NaN the model makes in any precision (an all-masked attention row,
``log(0)``) is not, and the origin says which.
"""

from __future__ import annotations

import collections
import contextlib
import copy as copy_module
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from torch import Tensor

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper, resolve_module
from lightning_amp_plus._tree import map_tensors, tensors

#: an origin: ``{"phase": "input" | "forward" | "loss" | "backward", ...}`` (see :meth:`OriginFinder.origin`)
Origin = dict[str, Any]

_replays = [0]  # replays in progress (other callbacks' hooks ignore their calls)


def replaying() -> bool:
    """Whether a replay is running: module hooks that record or measure a batch ignore the calls it makes."""
    return _replays[0] > 0


@contextlib.contextmanager
def replay_scope() -> Iterator[None]:
    """Mark the calls made inside as a replay's (an origin replay, a float32 reference), not the batch's."""
    _replays[0] += 1
    try:
        yield
    finally:
        _replays[0] -= 1


@dataclass
class BatchCalls:
    """One batch's recorded calls (name, module, args, kwargs, the inputs' version counters), batch and losses."""

    calls: list[tuple[str, torch.nn.Module, Any, Any, list[int]]] = field(default_factory=list)
    batch: Any = None
    losses: list[Tensor] = field(default_factory=list)


class _Unknown(Exception):
    """The replay cannot tell: an input was changed in place after its call (not as it ran)."""


class _Found(BaseException):
    """The origin is found: the replay stops there (a BaseException: a model's ``except Exception`` lets it pass)."""


@contextlib.contextmanager
def tensor_hooks_kept(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Hooks the recomputed step registers on parameters (``param.register_hook``) are gone afterwards."""
    kinds = ("_backward_hooks", "_post_accumulate_grad_hooks")
    saved = [(p, kind, getattr(p, kind, None)) for p in params for kind in kinds]
    copies = [dict(hooks) if hooks is not None else None for _, _, hooks in saved]
    try:
        yield
    finally:
        for (param, kind, hooks), copy in zip(saved, copies, strict=True):
            if hooks is None:
                if getattr(param, kind, None) is not None:
                    setattr(param, kind, None)
            else:
                hooks.clear()
                hooks.update(copy)


@contextlib.contextmanager
def no_logging(module: Any) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (the batch already logged its values)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = ignore, ignore
    try:
        yield
    finally:
        del module.log, module.log_dict


class OriginFinder:
    """Tell where a skipped update's non-finite values were born (Trainer; see the module docstring).

    Clean steps cost two Python calls per call of a recorded module (its inputs kept by reference until the batch
    ends; no device op, no sync). Use
    :meth:`attach` at fit start, :meth:`start_batch` / :meth:`add_loss` / :meth:`take_batch` around each training
    batch, and :meth:`origin` on a skip.

    Example:
        >>> import torch
        >>> finder = OriginFinder()
        >>> finder.origin(BatchCalls(batch=torch.tensor([float("nan")])))
        {'phase': 'input'}
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._module: Optional[torch.nn.Module] = None
        self._forward_context: Callable[[], Any] = contextlib.nullcontext
        self._current: Optional[BatchCalls] = None
        self._accumulating = False

    # ------------------------------------------------------------------ recording
    def attach(self, module: torch.nn.Module, forward_context: Callable[[], Any], accumulating: bool = False) -> None:
        """Record the calls of ``module``'s call frontier; replays run under ``forward_context`` (autocast).

        ``accumulating``: updates span several micro-batches, of which only the last is recorded, so a finite
        replay cannot say "backward".
        """
        self.detach()
        self._module = module
        self._forward_context = forward_context
        self._accumulating = accumulating
        for name, called in call_frontier(module):

            def keep(mod: torch.nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                current = self._current
                if current is None or _replays[0]:  # training batches only, not replays
                    return
                current.calls.append((name, mod, args, kwargs, versions(args, kwargs)))

            self._handles.append(called.register_forward_pre_hook(keep, with_kwargs=True))

    def detach(self) -> None:
        """Stop recording; forget the batch."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._current = None

    def start_batch(self, batch: Any) -> None:
        """Record this training batch's calls from now on."""
        self._current = BatchCalls(batch=batch)

    def add_loss(self, loss: Tensor) -> None:
        """A loss of this batch (a GAN backpropagates two)."""
        if self._current is not None:
            self._current.losses.append(loss)

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

        ``{"phase": "input"}``: the batch held inf/nan. ``{"phase": "forward", "module": name, "kind": "inf"|"nan",
        "float32": "finite"|"nonfinite"}``: the first module (in execution order) whose inputs were finite and whose
        output was not; ``module`` is ``""`` for the LightningModule's own code between its modules; ``float32``
        says what the module returned recomputed in float32 (``"finite"``: an fp16 overflow; ``"nonfinite"``: no
        precision avoids it). ``{"phase": "loss"}``: every module output finite, the loss not. ``{"phase":
        "backward"}``: forward and loss finite (the gradients overflowed).
        """
        record = record if record is not None else self._current
        if record is None or record.batch is None:
            return None
        if nonfinite_kind(record.batch) is not None:
            return {"phase": "input"}
        if self._module is None:
            return None  # not replayed (a sharded model: only the batch is told)
        try:
            with replay_scope():
                born = self._replay(record.calls)
        except _Unknown:
            return None
        if born is not None:
            return born
        if any(nonfinite_kind(loss.detach()) is not None for loss in record.losses):
            return {"phase": "loss"}
        if self._accumulating:
            return None  # an earlier micro-batch of the update may have made them: not replayed
        return {"phase": "backward"}

    def _replay(self, calls: list[Any]) -> Optional[Origin]:
        """Replay the recorded calls with every module hooked; the first module that made inf/nan."""
        found: list[Origin] = []
        with self._hooked([(name, called) for name, called, _, _, _ in calls], found):
            for _, called, args, kwargs, kept in calls:
                if versions(args, kwargs) != kept:
                    raise _Unknown  # changed in place after the call (by the module itself, maybe)
                kind = nonfinite_kind((args, kwargs), masks=True)
                if kind is not None:  # made between the recorded modules: the LightningModule's own code
                    return {"phase": "forward", "module": "", "kind": kind}
                with contextlib.suppress(_Found):
                    resolve_module(called)(*args, **kwargs)
                if found:
                    return found[0]
        return None

    @contextlib.contextmanager
    def _hooked(self, called: list[tuple[str, torch.nn.Module]], found: list[Origin]) -> Iterator[None]:
        """Every module inside ``called`` hooked, the model left as found: the first to make inf/nan goes in ``found``.

        Its output is recomputed in float32 on the same inputs, and the run stops there (``_Found``).
        """
        assert self._module is not None
        owners: dict[int, str] = {}
        handles: list[Any] = []
        device_type = _device_type(self._module)
        recomputing = [False]

        def post(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if found or recomputing[0]:
                return
            kind = nonfinite_kind(output, masks=True)
            if kind is None or nonfinite_kind((args, kwargs), masks=True) is not None:
                return
            recomputing[0] = True
            try:
                in_fp32 = _recompute_in_float32(mod, args, kwargs, device_type)
            finally:
                recomputing[0] = False
            found.append({"phase": "forward", "module": owners[id(mod)], "kind": kind, "float32": in_fp32})
            raise _Found

        try:
            for name, module in called:
                inner = resolve_module(module)  # a compiled module replays eagerly: no hook inside its graph
                for sub, child in inner.named_modules():
                    if id(child) not in owners:
                        owners[id(child)] = clean_name(f"{name}.{sub}" if sub else name)
                        handles.append(child.register_forward_hook(post, with_kwargs=True))
            with (
                leaves_no_trace(self._module, device_type),
                torch.no_grad(),
                self._forward_context(),
                all_eager(self._module),
            ):
                yield
        finally:
            for handle in handles:
                handle.remove()


#: how much an origin tells, most first: a rank that saw the inf/nan born outranks one whose forward was finite
_TELLING = {"input": 0, "loss": 1, "forward": 2, "backward": 3}


def job_origin(per_rank: list[Optional[Origin]]) -> Optional[Origin]:
    """The origin of one skipped update from every rank's: the most telling one, with the ``rank`` that saw it.

    With DDP every rank skips the update (its gradients are averaged), yet only the rank whose batch, loss or forward
    made the inf/nan can tell where they were born; the others replay a finite forward and would say "backward".

    Example:
        >>> job_origin([{"phase": "backward"}, {"phase": "input"}])
        {'phase': 'input', 'rank': 1}
        >>> job_origin([None, None]) is None
        True
    """
    told = [(rank, o) for rank, o in enumerate(per_rank) if o]
    if not told:
        return None
    if len(per_rank) == 1:
        return told[0][1]
    rank, origin = min(told, key=lambda pair: (_TELLING.get(str(pair[1].get("phase")), 9), pair[0]))
    return {**origin, "rank": rank}


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


def _recompute_in_float32(mod: torch.nn.Module, args: Any, kwargs: Any, device_type: str) -> str:
    """``"finite"`` when ``mod`` returns finite values in float32 on the same inputs, else ``"nonfinite"``."""

    def up(tensor: Tensor) -> Tensor:
        return tensor.float() if tensor.is_floating_point() else tensor

    with torch.autocast(device_type, enabled=False):
        output = mod(*map_tensors(up, args), **map_tensors(up, kwargs))
    return "finite" if nonfinite_kind(output, masks=True) is None else "nonfinite"


@contextlib.contextmanager
def leaves_no_trace(
    module: torch.nn.Module,
    device_type: str,
    what: str = "`OriginFinder`: a module's forward",
    hint: str = "`NaNSkipReporter(find_origin=False)` for a model whose forward writes its parameters",
) -> Iterator[None]:
    """Run a replay that leaves ``module`` as it found it.

    Restored afterwards: the random-number state, every buffer's values (running statistics updated in place), every
    buffer, parameter or attribute a module assigned (``self.mean = 0.9 * self.mean + ...``), and tensors held as
    plain attributes, and the contents of lists and dicts held as attributes (a list of losses, a metric's states).
    A parameter changed in place is an error (its values were not copied).
    """
    modules = list(module.modules())
    saved = [(m, dict(vars(m)), dict(m._buffers), dict(m._parameters), dict(m._modules)) for m in modules]
    containers = [
        (value, _structure(value))
        for m in modules
        for key, value in vars(m).items()
        if not key.startswith("_") and isinstance(value, _CONTAINERS)
    ]
    host_rng = host_random_state()
    generators = [(g, g.get_state()) for m in modules for g in vars(m).values() if isinstance(g, torch.Generator)]
    values = [(t, t.detach().clone()) for t in _held_tensors(modules)]
    params = [(p, p._version) for p in module.parameters()]
    devices = [torch.cuda.current_device()] if device_type == "cuda" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, copy in values:
                    tensor.copy_(copy)
            for m, attributes, buffers, parameters, children in saved:
                stores: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                    (m._buffers, buffers),
                    (m._parameters, parameters),
                    (m._modules, children),
                )
                # only what changed is written back: an untouched dict keeps its version (torch.compile's guards)
                for store, old in stores:
                    if not _unchanged(store, old):
                        store.clear()
                        store.update(old)
                for key in [k for k in vars(m) if k not in attributes]:
                    del m.__dict__[key]
                for key, value in attributes.items():
                    if m.__dict__.get(key, _ABSENT) is not value:
                        m.__dict__[key] = value
            for container, content in containers:
                if not _unchanged(container, content):
                    _restore_into(container, content)
            set_host_random_state(host_rng)
            for generator, state in generators:  # a module's own random stream (`torch.randn(..., generator=g)`)
                generator.set_state(state)
    changed = [p for p, version in params if p._version != version]
    if changed:
        raise RuntimeError(
            f"{what} changed {len(changed)} parameter(s) in place during a replay, which cannot undo it. HINT: {hint}."
        )


#: the Python containers a replay restores the contents of (nested ones included), as module attributes
_CONTAINERS = (list, dict, set, collections.deque)


def _structure(value: Any) -> Any:
    """A copy of ``value``'s containers, nested ones too, holding the very same leaves (tensors are not copied)."""
    if not isinstance(value, _CONTAINERS):
        return value
    copy: Any = copy_module.copy(value)  # the same class: a defaultdict keeps its factory, a deque its maxlen
    if isinstance(value, dict):
        copy.clear()
        copy.update({k: _structure(v) for k, v in value.items()})
    else:
        _restore_into(copy, [_structure(v) for v in value])
    return copy


_ABSENT = object()


def _unchanged(current: Any, saved: Any) -> bool:
    """Whether ``current`` holds what ``saved`` (its :func:`_structure` copy) holds: alike containers, same leaves."""
    if not isinstance(saved, _CONTAINERS):
        return current is saved
    if type(current) is not type(saved) or len(current) != len(saved):
        return False
    if isinstance(saved, dict):
        now = cast(dict, current)
        return all(k in now and _unchanged(now[k], v) for k, v in saved.items())
    if isinstance(saved, set):
        return current == saved
    return all(_unchanged(a, b) for a, b in zip(current, saved, strict=True))


def _restore_into(container: Any, content: Any) -> None:
    """Put ``content`` (a :func:`_structure` copy) back into ``container`` in place; nested containers as copied."""
    container.clear()
    if isinstance(container, dict):
        container.update(content)
    elif isinstance(container, (list, collections.deque)):
        container.extend(content)
    else:
        container.update(content)


def host_random_state() -> tuple[Any, Any]:
    """Python's and (when loaded) numpy's global random state: a replay that draws from them must not move them."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def set_host_random_state(state: tuple[Any, Any]) -> None:
    """Put back what :func:`host_random_state` saved."""
    python_state, numpy_state = state
    random.setstate(python_state)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def _held_tensors(modules: list[torch.nn.Module]) -> list[Tensor]:
    """Every buffer, and every tensor held as a plain attribute, once each (a replay may change them in place)."""
    seen: dict[int, Tensor] = {}
    for m in modules:
        for value in (*m._buffers.values(), *vars(m).values()):
            for tensor in tensors(value) if not isinstance(value, torch.nn.Module) else ():
                if not isinstance(tensor, torch.nn.Parameter):
                    seen.setdefault(id(tensor), tensor)
    return list(seen.values())


@contextlib.contextmanager
def all_eager(module: torch.nn.Module) -> Iterator[None]:
    """Every compiled module in ``module`` runs eagerly inside: a replay's hooks must run, never be traced.

    ``torch.compiler.set_stance("force_eager")`` where torch has it (>= 2.6); before, each ``torch.compile`` wrapper's
    compiled ``forward`` is set aside for its module's own call, and put back.
    """
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    swapped = [m for m in module.modules() if is_compiled_wrapper(m) and "forward" in vars(m)]
    saved = [vars(m)["forward"] for m in swapped]
    try:
        for wrapper in swapped:
            wrapper.forward = wrapper._orig_mod.__call__  # type: ignore[method-assign,operator]
        yield
    finally:
        for wrapper, forward in zip(swapped, saved, strict=True):
            wrapper.forward = forward  # type: ignore[method-assign]


def nonfinite_kind(value: Any, masks: bool = False) -> Optional[str]:
    """``"inf"`` or ``"nan"`` for the first floating tensor in ``value`` (nested lists, tuples, dicts) holding one.

    With ``masks``, ``-inf`` alone does not count: attention masks between modules hold it by design (an overflow to
    ``-inf`` shows as ``nan`` or ``+inf`` one module later). A batch is checked without.
    """
    for tensor in tensors(value):
        if tensor.is_floating_point():
            if bool(torch.isposinf(tensor).any()) or (not masks and bool(torch.isneginf(tensor).any())):
                return "inf"
            if bool(torch.isnan(tensor).any()):
                return "nan"
    return None


def versions(args: Any, kwargs: Any) -> list[int]:
    """The version counters of a call's tensors: an in-place change later shows as a different number."""
    found = []
    for arg in args:  # flat arguments, the common case, without a nested call
        if isinstance(arg, Tensor):
            found.append(arg._version)
        elif isinstance(arg, (list, tuple, dict)):
            found.extend(t._version for t in tensors(arg))
    if kwargs:
        found.extend(t._version for t in tensors(kwargs))
    return found
