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
import functools
import random
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar, cast

import torch
from torch import Tensor

from lightning_amp_plus._identity import is_compiled_wrapper
from lightning_amp_plus._tree import leaves, map_tensors, version

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
#: globals a forward names that are code, not state (functions, classes, modules)
_GLOBAL_LEAVES = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType)


@dataclass
class Reach:
    """What a replay's code can reach: modules, tensors, random streams, containers, plain objects, globals.

    Modules registered or held as attributes; the mutable containers and the user's plain objects they hold; the
    globals the modules' ``forward`` functions name (a module-level generator or counter).
    """

    modules: list[torch.nn.Module]
    tensors: list[Tensor]
    streams: list[Any]
    containers: list[Any] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    globals: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    complete: bool = True  # False: more than the walk visits (what it left could not be put back)


def reach(*roots: Any) -> Reach:
    """Walk what ``roots`` (modules, a call's arguments) reach; bounded, and it never raises.

    Module trees, what their modules hold as attributes (containers, plain objects), the globals their ``forward``
    reads.
    """
    found = Reach([], [], [])
    seen: set[int] = set()
    pending: list[tuple[Any, int]] = [(root, 0) for root in roots]
    while pending and len(seen) < _VISITS:
        value, depth = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        try:
            _visit(value, depth, found, seen, pending)
        except ReferenceError:  # a dead weak proxy: nothing to reach
            continue
    found.complete = not pending
    return found


def _visit(value: Any, depth: int, found: Reach, seen: set[int], pending: list[tuple[Any, int]]) -> None:
    if isinstance(value, torch.nn.Module):
        for m in value.modules():
            if m is value or id(m) not in seen:
                seen.add(id(m))
                found.modules.append(m)
                pending.extend((v, 1) for k, v in vars(m).items() if k not in _OWN_STORES)
                pending.extend((g, 1) for g in _forward_globals(m, found))
                pending.extend((g, 1) for hook in _hooks(m) for g in _function_state(hook, found))
    elif isinstance(value, Tensor):
        found.tensors.append(value)
    elif _is_stream(value):
        found.streams.append(value)
    elif depth < _DEPTH:
        if isinstance(value, _MUTABLE):
            found.containers.append(value)
        elif _is_users(value):
            found.objects.append(value)
        pending.extend((v, depth + 1) for v in _children(value) if not isinstance(v, _LEAVES))  # no state in a leaf


def _forward_globals(module: torch.nn.Module, found: Reach) -> list[Any]:
    """The global values a module class's ``forward`` names (a module-level generator, a counter): kept by name."""
    if type(module).__module__.split(".")[0] in _MACHINERY:
        return []
    return _function_state(getattr(type(module), "forward", None), found)


#: a module's hook stores: a user's hook runs in a replay too, what it records is put back
_HOOK_STORES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooks(module: torch.nn.Module) -> list[Any]:
    return [hook for store in _HOOK_STORES for hook in getattr(module, store, {}).values()]


def _function_state(function: Any, found: Reach) -> list[Any]:
    """What a user's function can change: the globals it names (kept by name), its closure, its bound object."""
    if isinstance(function, functools.partial):
        return [function.func, *function.args, *function.keywords.values()]
    bound = getattr(function, "__self__", None)
    function = getattr(function, "__func__", function)
    code, namespace = getattr(function, "__code__", None), getattr(function, "__globals__", None)
    if code is None or namespace is None or str(getattr(function, "__module__", "")).split(".")[0] in _MACHINERY:
        return []
    names = [n for n in code.co_names if n in namespace and not isinstance(namespace[n], _GLOBAL_LEAVES)]
    found.globals.extend((namespace, n) for n in names)
    cells = [c.cell_contents for c in function.__closure__ or () if _filled(c)]
    return [namespace[n] for n in names] + cells + ([bound] if bound is not None else [])


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _ABSENT
    except ValueError:  # an empty cell
        return False


def _is_users(value: Any) -> bool:
    """A plain object of the user's with attributes (not the run's machinery, not a module-like type)."""
    if isinstance(value, _LEAVES) or not hasattr(value, "__dict__"):
        return False
    return type(value).__module__.split(".")[0] not in _MACHINERY


def _children(value: Any) -> list[Any]:
    """The values inside a container or a plain object of the user's (never the run's machinery)."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, _CONTAINERS):
        return list(value)
    return list(vars(value).values()) if _is_users(value) else []


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
    roots: Any, device_type: str, start: Optional[StepStart] = None, grad: bool = False, streams: Any = ()
) -> Iterator[Box]:
    """Run a replay of code that leaves the run exactly as it was (see the module docstring).

    ``roots``: the module (or a tuple of modules and a call's arguments) whose code runs: whatever they reach is
    covered. ``start``: the random state to replay from. ``grad``: parameters' stand-ins require grad as the
    originals do (a replay that takes gradients); otherwise they are plain copies. ``streams``: other random streams
    the replay sets (a recorded start's, restored inside): given back too.
    """
    roots = roots if isinstance(roots, tuple) else (roots,)
    tree = reach(*roots)
    if not tree.complete:
        raise RuntimeError(f"the code reaches more than {_VISITS} objects: a replay could not put each back")
    restored = [stream for stream, _ in (start.owned or []) + (start.host or [])] if start is not None else []
    states = capture([*global_streams(device_type), *tree.streams, *restored, *streams])
    modules = [r for r in roots if isinstance(r, torch.nn.Module)]
    with (
        replay_scope(),
        no_collectives(),
        _kept(tree),
        _stand_ins(tree, grad) as copies,
        contextlib.ExitStack() as eager,
    ):
        for module in modules:
            eager.enter_context(all_eager(module))
        try:
            if start is not None:
                start.restore()
            yield Box(tree.streams, copies)
        finally:
            give_back(states)


@contextlib.contextmanager
def _stand_ins(tree: Reach, grad: bool) -> Iterator[dict[int, Tensor]]:
    """Every parameter and buffer replaced by a copy (tied ones stay tied) for the duration.

    In its module's dicts, and in the lists and dicts the replay's code reaches (an EMA's list of parameters). A real
    tensor written all the same (through a reference held outside what the replay reaches) is put back: a ``.data``
    assignment from the storage kept, an in-place write from its untouched stand-in.
    """
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for m in tree.modules:
        saved.extend([(m._parameters, dict(m._parameters)), (m._buffers, dict(m._buffers))])
    reals = {id(t): t for _, old in saved for t in old.values() if t is not None}
    marks = {key: (version(t), t.data_ptr(), t.data) for key, t in reals.items()}
    copies: dict[int, Tensor] = {}
    for key, t in reals.items():
        copy = t.detach().clone()
        copies[key] = (
            torch.nn.Parameter(copy, requires_grad=grad and t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else copy
        )
    stand_in_versions = {key: version(c) for key, c in copies.items()}
    try:
        for store, old in saved:
            store.update({name: copies[id(t)] for name, t in old.items() if t is not None})
        for container in tree.containers:  # put back by `_kept`, which saw them first
            _substitute(container, copies)
        yield copies
    finally:
        for store, old in saved:
            store.clear()
            store.update(old)
        for key, t in reals.items():
            was, pointer, storage = marks[key]
            if t.data_ptr() != pointer:
                t.data = storage  # `.data = ...` on a reference the stand-ins did not cover
            if version(t) != was and version(copies[key]) == stand_in_versions[key]:
                with torch.no_grad():
                    t.data.copy_(copies[key])  # written in place through such a reference: the copy is untouched


def _substitute(container: Any, copies: dict[int, Tensor]) -> None:
    """Each real parameter or buffer in ``container`` (a list, dict or deque) swapped for its stand-in.

    Directly, or inside the tuples it holds (``list(zip(teacher.parameters(), student.parameters()))``).
    """
    if isinstance(container, dict):
        for key, value in list(container.items()):
            swapped = _swapped(value, copies)
            if swapped is not value:
                container[key] = swapped
    elif isinstance(container, (list, collections.deque)):
        for index, value in enumerate(list(container)):
            swapped = _swapped(value, copies)
            if swapped is not value:
                container[index] = swapped


def _swapped(value: Any, copies: dict[int, Tensor]) -> Any:
    """``value`` with its stand-in in place of a real tensor, through tuples; ``value`` itself when nothing changes.

    A mutable container inside is swapped in place by its own entry (the replay's code may hold it).
    """
    if isinstance(value, (Tensor, tuple)):
        return map_tensors(lambda t: copies.get(id(t), t), value)
    return value


@contextlib.contextmanager
def _kept(tree: Reach) -> Iterator[None]:
    """Put back what the replay's code may change other than parameters and buffers.

    Every attribute of the modules and plain objects it reaches, the contents of the containers it reaches, tensors
    held as plain attributes (``.data`` writes too), and the globals its modules' ``forward`` names.
    """
    modules = [(m, dict(vars(m)), dict(m._modules)) for m in tree.modules]
    objects = [(o, dict(vars(o))) for o in tree.objects]
    containers = [(c, _structure(c)) for c in tree.containers]
    owned = {id(t) for m in tree.modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
    held = [(t, t.data, t.detach().clone()) for t in _bases(tree.tensors) if id(t) not in owned]
    names = [(namespace, name, namespace[name]) for namespace, name in tree.globals]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, storage, copy in held:
                if tensor.data_ptr() != storage.data_ptr():
                    tensor.data = storage
                with torch.inference_mode(tensor.is_inference()):
                    tensor.data.copy_(copy)  # through `.data`: no version counter moves
        for m, attributes, children in modules:
            if not _unchanged(m._modules, children):
                m._modules.clear()
                m._modules.update(children)
            _put_back(vars(m), attributes)
        for o, attributes in objects:
            _put_back(vars(o), attributes)
        for container, content in containers:
            if not _unchanged(container, content):
                _restore_into(container, content)
        for namespace, name, value in names:
            if namespace.get(name, _ABSENT) is not value:
                namespace[name] = value


def _bases(held: list[Tensor]) -> list[Tensor]:
    """The tensors that own the memory ``held`` tensors show: a view's base in its place, once.

    A view may show one element twice (an ``expand``): it cannot be written back, its base can.
    """
    bases: dict[int, Tensor] = {}
    for t in held:
        while t._base is not None:
            t = t._base
        bases.setdefault(id(t), t)
    return list(bases.values())


def _put_back(now: dict[str, Any], saved: dict[str, Any]) -> None:
    """An object's attributes as they were: added ones gone, changed ones the saved values (only what changed)."""
    for key in [k for k in now if k not in saved]:
        del now[key]
    for key, value in saved.items():
        if now.get(key, _ABSENT) is not value:
            now[key] = value


#: what a replay may not call: it runs on one rank, the others would wait for it (or answer with their values)
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather",
    "scatter", "send", "recv", "isend", "irecv", "gather_object", "scatter_object_list",
)  # fmt: skip


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Inside, a ``torch.distributed`` collective raises instead of running: a replay runs on one rank only."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    def refuse(name: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"a replay runs on one rank and cannot take part in a collective (`{name}`)")

        return collective

    patched = [
        (namespace, name, getattr(namespace, name))
        for namespace in (torch.distributed, c10d)
        for name in _COLLECTIVES
        if hasattr(namespace, name)
    ]
    try:
        for namespace, name, _ in patched:
            setattr(namespace, name, refuse(name))
        yield
    finally:
        for namespace, name, original in patched:
            setattr(namespace, name, original)


#: the Python containers whose contents a replay restores (nested ones included), as module attributes
_MUTABLE = (list, dict, set, collections.deque)
_ABSENT = object()


def _structure(value: Any) -> Any:
    """A copy of ``value``'s containers, nested ones too, holding the very same leaves (tensors are not copied)."""
    if not isinstance(value, _MUTABLE):
        return value
    copy: Any = copy_module.copy(value)  # the same class: a defaultdict keeps its factory, a deque its maxlen
    _restore_into(
        copy, {k: _structure(v) for k, v in value.items()} if isinstance(value, dict) else map(_structure, value)
    )
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
    """Put ``content`` (a :func:`_structure` copy) back into ``container`` in place, by its built-in type's methods.

    A subclass's own methods are the user's code (a transformers ``ModelOutput`` refuses ``update``).
    """
    base: Any = next(
        t for t in (collections.OrderedDict, dict, collections.deque, list, set) if isinstance(container, t)
    )
    base.clear(container)
    (base.extend if base in (collections.deque, list) else base.update)(container, content)


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
    return any(not isinstance(leaf, _PLAIN) for leaf in leaves(value))


def _detached_copy(tensor: Tensor) -> Tensor:
    copy = tensor.detach().clone()
    return copy.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else copy


def _copied_state(value: Any) -> Any:
    """A leaf of a call's arguments for a replay: a plain value as it is, an object that may hold state deep-copied.

    The tensors it holds are copied detached (a cache's keys are no leaves: deepcopy refuses those).
    """
    if isinstance(value, _PLAIN):
        return value
    try:
        memo: dict[int, Any] = {id(t): _detached_copy(t) for t in reach(value).tensors}
        return copy_module.deepcopy(value, memo)
    except Exception as error:
        raise TypeError(f"an argument of type {type(value).__name__} cannot be copied ({raised(error)})") from None


def copied_inputs(value: Any) -> Any:
    """A call's arguments for a replay: tensors copied (the user's own tensors never written), stateful objects too.

    Every container is a new one (:func:`~lightning_amp_plus._tree.map_tensors`); an argument that is not a tensor, a
    plain value or a container (a key/value cache, say) is deep-copied: the replay may change it, the original must
    not change. One that cannot be copied raises ``TypeError`` (the replay is then told, not run).
    """
    return map_tensors(_detached_copy, value, _copied_state, fresh=True)
