"""The sandbox every replay of the user's code runs in: it cannot change the run, and it cannot raise into it.

A diagnostic that runs a module (or, opted in by name, ``training_step``) a second time must leave the run bit for
bit as it was, whatever the code does. Inside :func:`sandboxed`:

* every parameter and buffer of the module tree is a stand-in, a copy put in its module's place for the duration
  (``torch.func.functional_call`` style): an in-place write, a ``.data`` assignment, a running-statistics update land
  on the copy;
* every random stream is given back afterwards: torch's, Python's and numpy's global ones, and every
  ``torch.Generator``, ``random.Random`` and numpy ``Generator``/``RandomState`` reachable from the module tree
  (a module's own, an environment's);
* every attribute a module assigns, the contents of lists, dicts, sets and deques held as attributes, and tensors
  held as plain attributes are put back;
* a replay starts from the random state the step started from, when the caller hands it over (:class:`StepStart`).

What the sandbox cannot undo is what the code does outside the module tree (a file written, an environment object
stepped, a logger called directly): nothing replays ``training_step`` unless the user asks for it by name, and the
documentation says what such a step may do. :func:`attempt` turns any exception of a replay into a told outcome.
"""

from __future__ import annotations

import collections
import contextlib
import copy as copy_module
import random
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, cast

import torch
from torch import Tensor

from lightning_amp_plus._identity import is_compiled_wrapper

_replays = [0]  # replays in progress (other callbacks' hooks ignore their calls)

T = TypeVar("T")


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


def attempt(run: Callable[..., T], *args: Any) -> tuple[Optional[T], Optional[str]]:
    """``run(*args)``'s result and None, or None and what it raised (``"RuntimeError: ..."``): a replay never raises."""
    try:
        return run(*args), None
    except Exception as error:  # a told outcome: the training run goes on
        return None, raised(error)


def raised(error: BaseException) -> str:
    """``"RuntimeError: the message"`` (its first line, at most 200 characters)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


# ---------------------------------------------------------------------------------------------- random streams
def _numpy() -> Any:
    return sys.modules.get("numpy")


def _stream_state(stream: Any) -> Any:
    """A random stream's state (``torch.Generator``, ``random.Random``, numpy ``RandomState`` or ``Generator``)."""
    if isinstance(stream, torch.Generator):
        return stream.get_state()
    if isinstance(stream, random.Random):
        return stream.getstate()
    if hasattr(stream, "bit_generator"):  # numpy.random.Generator
        return stream.bit_generator.state
    return stream.get_state()  # numpy.random.RandomState


def _set_stream_state(stream: Any, state: Any) -> None:
    if isinstance(stream, torch.Generator):
        stream.set_state(state)
    elif isinstance(stream, random.Random):
        stream.setstate(state)
    elif hasattr(stream, "bit_generator"):
        stream.bit_generator.state = state
    else:
        stream.set_state(state)


def _is_stream(value: Any) -> bool:
    if isinstance(value, torch.Generator):
        return True
    if isinstance(value, random.Random):
        return type(value) is not random.SystemRandom  # no state to give back
    numpy = _numpy()
    return numpy is not None and isinstance(value, (numpy.random.RandomState, numpy.random.Generator))


def global_streams(device_type: str = "cpu") -> list[Any]:
    """The global random streams: torch's CPU generator (and the CUDA ones in use), Python's, numpy's."""
    streams: list[Any] = [torch.default_generator, random._inst]  # type: ignore[attr-defined]
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        streams.extend(torch.cuda.default_generators)
    numpy = _numpy()
    if numpy is not None:
        streams.append(numpy.random.mtrand._rand)
    return streams


def capture(streams: list[Any]) -> list[tuple[Any, Any]]:
    """Each stream with its state now."""
    return [(stream, _stream_state(stream)) for stream in streams]


def give_back(states: list[tuple[Any, Any]]) -> None:
    """Put every stream back in the state :func:`capture` saw."""
    for stream, state in states:
        _set_stream_state(stream, state)


# ---------------------------------------------------------------------------------------------- what a tree reaches
#: objects of these packages are the run's machinery, not the user's state: never walked into
_MACHINERY = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_amp_plus",
    "torch",
    "numpy",
    "tensorboard",
)
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
#: how deep the walk goes into plain objects and containers held as module attributes, and how many it visits
_DEPTH, _VISITS = 4, 20_000
#: a module's own stores of parameters, buffers and children: the stand-ins and the module walk cover them
_OWN_STORES = ("_parameters", "_buffers", "_modules")
#: values that hold no state of the user's to walk into
_LEAVES = (str, bytes, int, float, complex, bool, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


@dataclass
class Reach:
    """What a module tree reaches through its attributes: modules (registered or held), tensors, random streams."""

    modules: list[torch.nn.Module]
    tensors: list[Tensor]
    streams: list[Any]


def reach(module: torch.nn.Module) -> Reach:
    """Walk ``module``'s tree and what its modules hold as attributes (containers, plain objects, bounded)."""
    modules: dict[int, torch.nn.Module] = {}
    tensors: dict[int, Tensor] = {}
    streams: dict[int, Any] = {}
    seen: set[int] = set()
    pending: list[tuple[Any, int]] = [(module, 0)]
    while pending and len(seen) < _VISITS:
        value, depth = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                if id(m) not in modules:
                    modules[id(m)] = m
                    seen.add(id(m))
                    pending.extend((v, 1) for k, v in vars(m).items() if k not in _OWN_STORES)
        elif isinstance(value, Tensor):
            tensors.setdefault(id(value), value)
        elif _is_stream(value):
            streams.setdefault(id(value), value)
        elif depth < _DEPTH:
            pending.extend((v, depth + 1) for v in _children(value))
    return Reach(list(modules.values()), list(tensors.values()), list(streams.values()))


def _children(value: Any) -> list[Any]:
    """The values inside a container or a plain object of the user's (never the run's machinery)."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, _CONTAINERS):
        return list(value)
    if isinstance(value, _LEAVES):
        return []
    owner = type(value).__module__.split(".")[0]
    if owner in _MACHINERY or not hasattr(value, "__dict__"):
        return []
    return list(vars(value).values())


# ---------------------------------------------------------------------------------------------- the step's start
@dataclass
class StepStart:
    """The random state a step (or one call in it) started from: a replay starts there too.

    ``torch`` holds the CPU generator's state (and ``cuda`` the current CUDA device's), ``owned`` the states of
    streams the module tree holds, ``host`` Python's and numpy's global states when they were recorded (only where
    recording them is cheap enough: a measured batch, not every batch).
    """

    torch: Tensor
    cuda: Optional[Tensor] = None
    owned: Optional[list[tuple[Any, Any]]] = None
    host: Optional[list[tuple[Any, Any]]] = None

    def restore(self) -> None:
        """Set every stream it holds to the state recorded."""
        torch.default_generator.set_state(self.torch)
        if self.cuda is not None:
            torch.cuda.default_generators[torch.cuda.current_device()].set_state(self.cuda)
        give_back(self.owned or [])
        give_back(self.host or [])


# ---------------------------------------------------------------------------------------------- the sandbox
@dataclass
class Box:
    """Inside a sandbox: the random streams the tree reaches, and each real parameter's or buffer's stand-in."""

    streams: list[Any]
    stand_ins: dict[int, Tensor]

    def stand_in(self, tensor: Tensor) -> Tensor:
        """The copy that stands in for ``tensor`` (a parameter or buffer of the tree) inside the sandbox."""
        return self.stand_ins[id(tensor)]


@contextlib.contextmanager
def sandboxed(
    module: torch.nn.Module, device_type: str, start: Optional[StepStart] = None, grad: bool = False
) -> Iterator[Box]:
    """Run a replay of ``module``'s code that leaves the run exactly as it was (see the module docstring).

    ``start``: the random state to replay from. ``grad``: parameters' stand-ins require grad as the originals do
    (a replay that takes gradients); otherwise they are plain copies.
    """
    tree = reach(module)
    states = capture([*global_streams(device_type), *tree.streams])
    with replay_scope(), _attributes_kept(tree), _stand_ins(tree.modules, grad) as copies, all_eager(module):
        try:
            if start is not None:
                start.restore()
            yield Box(tree.streams, copies)
        finally:
            give_back(states)


@contextlib.contextmanager
def _stand_ins(modules: list[torch.nn.Module], grad: bool) -> Iterator[dict[int, Tensor]]:
    """Every parameter and buffer replaced, in its module's dicts, by a copy (tied ones stay tied) for the duration.

    A real tensor written all the same (through a reference held outside the module tree) is put back: a
    ``.data`` assignment from the storage kept, an in-place write from its untouched stand-in.
    """
    copies: dict[int, Tensor] = {}
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for m in modules:
        saved.extend([(m._parameters, dict(m._parameters)), (m._buffers, dict(m._buffers))])
    reals = {id(t): t for _, old in saved for t in old.values() if t is not None}
    marks = {key: (t._version, t.data_ptr(), t.data) for key, t in reals.items()}
    for key, t in reals.items():
        copy = t.detach().clone()
        if isinstance(t, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=grad and t.requires_grad)
        copies[key] = copy
    stand_in_versions = {key: c._version for key, c in copies.items()}
    try:
        for store, old in saved:
            for name, t in old.items():
                if t is not None:
                    store[name] = copies[id(t)]
        yield copies
    finally:
        for store, old in saved:
            store.clear()
            store.update(old)
        for key, t in reals.items():
            version, pointer, storage = marks[key]
            if t.data_ptr() != pointer:
                t.data = storage  # `.data = ...` on a reference the stand-ins did not cover
            if t._version != version and copies[key]._version == stand_in_versions[key]:
                with torch.no_grad():
                    t.data.copy_(copies[key])  # written in place through such a reference: the copy is untouched


@contextlib.contextmanager
def _attributes_kept(tree: Reach) -> Iterator[None]:
    """Every module attribute, container held as an attribute, and tensor held as a plain attribute, put back."""
    saved = [(m, dict(vars(m)), dict(m._modules)) for m in tree.modules]
    containers = [
        (value, _structure(value))
        for m in tree.modules
        for key, value in vars(m).items()
        if not key.startswith("_") and isinstance(value, _MUTABLE)
    ]
    held = [t for t in tree.tensors if not isinstance(t, torch.nn.Parameter)]
    values = [(t, t._version, t.detach().clone()) for t in held]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, version, copy in values:
                if tensor._version != version:
                    tensor.copy_(copy)
        for m, attributes, children in saved:
            if not _unchanged(m._modules, children):
                m._modules.clear()
                m._modules.update(children)
            for key in [k for k in vars(m) if k not in attributes]:
                del m.__dict__[key]
            for key, value in attributes.items():
                if m.__dict__.get(key, _ABSENT) is not value:
                    m.__dict__[key] = value
        for container, content in containers:
            if not _unchanged(container, content):
                _restore_into(container, content)


#: the Python containers whose contents a replay restores (nested ones included), as module attributes
_MUTABLE = (list, dict, set, collections.deque)
_ABSENT = object()


def _structure(value: Any) -> Any:
    """A copy of ``value``'s containers, nested ones too, holding the very same leaves (tensors are not copied)."""
    if not isinstance(value, _MUTABLE):
        return value
    copy: Any = copy_module.copy(value)  # the same class: a defaultdict keeps its factory, a deque its maxlen
    if isinstance(value, dict):
        copy.clear()
        copy.update({k: _structure(v) for k, v in value.items()})
    else:
        _restore_into(copy, [_structure(v) for v in value])
    return copy


def _unchanged(current: Any, saved: Any) -> bool:
    """Whether ``current`` holds what ``saved`` (its :func:`_structure` copy) holds: alike containers, same leaves."""
    if not isinstance(saved, _MUTABLE):
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


#: argument values that hold no state a call could change
_PLAIN = (str, bytes, int, float, complex, bool, torch.dtype, torch.device, slice, type(None), type(Ellipsis))


def holds_state(value: Any) -> bool:
    """Whether a call's arguments hold an object other than tensors, plain values and containers of them.

    Such an object (a key/value cache a module appends to, say) may change in the call: a recompute of the call
    must start from a copy taken before it.
    """
    if isinstance(value, (Tensor, *_PLAIN)):
        return False
    if isinstance(value, (list, tuple)) or type(value) is dict:
        return any(holds_state(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


def copied_inputs(value: Any) -> Any:
    """A call's arguments for a replay: tensors copied (the user's own tensors never written), stateful objects too.

    An argument that is not a tensor, a number, a string or a container of those (a key/value cache, say) is
    deep-copied: the replay may change it, the original must not change. One that cannot be copied raises
    ``TypeError`` (the replay is then told, not run).
    """
    if isinstance(value, Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad) if value.is_floating_point() else copy
    if isinstance(value, (list, tuple)):
        items = [copied_inputs(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict) and type(value) is dict:
        return {k: copied_inputs(v) for k, v in value.items()}
    if isinstance(value, _PLAIN):
        return value
    try:
        return copy_module.deepcopy(value)
    except Exception as error:
        raise TypeError(f"an argument of type {type(value).__name__} cannot be copied ({raised(error)})") from None
