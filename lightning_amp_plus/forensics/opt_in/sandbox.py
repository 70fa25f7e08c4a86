"""The sandbox an opt-in replay runs in, and what it guarantees.

Inside :func:`sandboxed` every parameter and buffer of the replayed modules is a stand-in, a copy put in its place
(``torch.func.functional_call`` style), and every random stream it can reach is given back afterwards: torch's,
Python's and numpy's global ones, and each generator a module holds as an attribute. The call's arguments are copies.
Anything else the replayed code does (a global appended to, a file written, a counter in C) happens again: that is
why nothing replays your code unless you ask for it by name.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_amp_plus._identity import is_compiled_wrapper
from lightning_amp_plus.forensics import _safe
from lightning_amp_plus.forensics._safe import raised
from lightning_amp_plus.forensics._tree import map_tensors, version

#: random streams and the states :func:`capture` saw
States = list[tuple[Any, Any]]


# ---------------------------------------------------------------------------------------------- random streams
def _is_stream(value: Any) -> bool:
    np_random = getattr(sys.modules.get("numpy"), "random", None)
    kinds = (torch.Generator, random.Random, *((np_random.RandomState, np_random.Generator) if np_random else ()))
    return isinstance(value, kinds) and type(value) is not random.SystemRandom  # (no state to give back)


def streams(device_type: str, *modules: torch.nn.Module) -> list[Any]:
    """Every random stream a replay can reach: the global ones, and the generators ``modules`` hold as attributes.

    Torch's, the CUDA ones in use, Python's and numpy's; a module's directly or in a list, tuple or dict attribute.
    """
    found: dict[int, Any] = {id(s): s for s in (torch.default_generator, random._inst)}  # type: ignore[attr-defined]
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        found.update((id(g), g) for g in torch.cuda.default_generators)
    if "numpy" in sys.modules:
        found[0] = sys.modules["numpy"].random.mtrand._rand
    for m in (m for module in modules for m in module.modules()):
        for value in vars(m).values():
            with contextlib.suppress(ReferenceError):  # a dead weak proxy holds nothing
                inside = (
                    value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
                )
                found.update((id(v), v) for v in (value, *inside) if _is_stream(v))
    return list(found.values())


def capture(kept: list[Any]) -> States:
    """Each stream with its state now."""
    return [(s, _get(s)) for s in kept]


def _get(s: Any) -> Any:
    if isinstance(s, random.Random):
        return s.getstate()
    return s.bit_generator.state if hasattr(s, "bit_generator") else s.get_state()


def give_back(states: States) -> None:
    """Put every stream back in the state :func:`capture` saw."""
    for s, state in states:
        if isinstance(s, random.Random):
            s.setstate(state)
        elif hasattr(s, "bit_generator"):
            s.bit_generator.state = state
        else:
            s.set_state(state)


# ---------------------------------------------------------------------------------------------- the sandbox
@contextlib.contextmanager
def sandboxed(modules: list[torch.nn.Module], device_type: str, start: Optional[States] = None) -> Iterator[dict]:
    """Run a replay of ``modules``' code on stand-ins, from ``start``, every random stream given back after.

    Yields the stand-ins by the real tensors' ``id``; a parameter's requires grad as the original does. A real
    parameter or buffer written all the same (through a reference held elsewhere) is put back. Compiled modules run
    eagerly inside; a ``torch.distributed`` collective raises (a replay runs on one rank: the others would wait).
    """
    states = capture(streams(device_type, *modules) + [s for s, _ in start or []])
    _safe.replays[0] += 1
    try:
        with _stand_ins(modules) as copies, _no_collectives(), contextlib.ExitStack() as eager:
            for module in modules:
                eager.enter_context(all_eager(module))
            give_back(start or [])
            yield copies
    finally:
        _safe.replays[0] -= 1
        give_back(states)


@contextlib.contextmanager
def _stand_ins(modules: list[torch.nn.Module]) -> Iterator[dict[int, Tensor]]:
    stores: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (store, dict(store)) for module in modules for m in module.modules() for store in (m._parameters, m._buffers)
    ]
    reals = {id(t): t for _, old in stores for t in old.values() if t is not None}
    marks = {key: (version(t), t.data) for key, t in reals.items()}
    copies = {
        key: torch.nn.Parameter(t.detach().clone(), t.requires_grad) if isinstance(t, torch.nn.Parameter) else t.clone()
        for key, t in reals.items()
    }
    try:
        for store, old in stores:
            store.update({name: copies[id(t)] for name, t in old.items() if t is not None})
        yield copies
    finally:
        for store, old in stores:
            store.clear()
            store.update(old)
        with torch.no_grad():
            for key, t in reals.items():
                was, storage = marks[key]
                if t.data_ptr() != storage.data_ptr():
                    t.data = storage  # `.data = ...` through a reference the stand-ins did not cover
                if version(t) != was and version(copies[key]) == 0:
                    t.data.copy_(copies[key].data)  # written in place elsewhere: its stand-in holds what it was


@contextlib.contextmanager
def _no_collectives() -> Iterator[None]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    def refuse(name: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"a replay runs on one rank and cannot take part in a collective (`{name}`)")

        return collective

    names = [n for n in dir(c10d) if n in _COLLECTIVES]
    patched = [(ns, n, getattr(ns, n)) for ns in (torch.distributed, c10d) for n in names if hasattr(ns, n)]
    try:
        for namespace, name, _ in patched:
            setattr(namespace, name, refuse(name))
        yield
    finally:
        for namespace, name, original in patched:
            setattr(namespace, name, original)


_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather",
    "scatter", "send", "recv", "isend", "irecv", "gather_object", "scatter_object_list",
}  # fmt: skip


@contextlib.contextmanager
def all_eager(module: torch.nn.Module) -> Iterator[None]:
    """Every compiled module in ``module`` runs eagerly inside: a replay's hooks must run, never be traced."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is not None:  # torch >= 2.6
        with set_stance("force_eager"):
            yield
        return
    swapped = [(m, vars(m)["forward"]) for m in module.modules() if is_compiled_wrapper(m) and "forward" in vars(m)]
    try:
        for wrapper, _ in swapped:
            wrapper.forward = wrapper._orig_mod.__call__  # type: ignore[method-assign,operator]
        yield
    finally:
        for wrapper, forward in swapped:
            wrapper.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def no_logging(module: Any) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (the batch already logged its values)."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict


#: argument values that hold no state a call could change
_PLAIN = (str, bytes, int, float, complex, bool, torch.dtype, torch.device, slice, type(None), type(Ellipsis))


def _detached_copy(tensor: Tensor) -> Tensor:
    copied = tensor.detach().clone()
    return copied.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else copied


def _copied_object(value: Any) -> Any:
    """An argument that may hold state (a key/value cache), deep-copied; the tensors it holds copied detached."""
    if isinstance(value, _PLAIN):
        return value
    memo, pending, seen = {}, [(value, 0)], set()
    while pending:
        held, depth = pending.pop()
        if id(held) in seen:
            continue
        seen.add(id(held))
        if isinstance(held, Tensor):
            memo[id(held)] = _detached_copy(held)
        elif depth < 4 and not isinstance(held, _PLAIN):
            inside = held.values() if isinstance(held, dict) else held if isinstance(held, (list, tuple, set)) else ()
            pending += [(v, depth + 1) for v in (*inside, *getattr(held, "__dict__", {}).values())]
    try:
        return copy.deepcopy(value, memo)
    except Exception as error:
        raise TypeError(f"an argument of type {type(value).__name__} cannot be copied ({raised(error)})") from None


def copied_inputs(value: Any) -> Any:
    """A call's arguments for a replay: tensors copied detached, an object that may hold state deep-copied.

    Every container is a new one; an argument that cannot be copied raises ``TypeError`` (the replay is told).
    """
    return map_tensors(_detached_copy, value, _copied_object, fresh=True)
