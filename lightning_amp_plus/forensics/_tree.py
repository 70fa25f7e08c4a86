"""The one container walker (the watch, the replay, the fp32 islands and the reports read and copy through it).

Containers: lists and tuples, dicts, dataclasses (their subclasses too), and, two levels deep at most, ``UserDict``
(``BatchEncoding``) and ``SimpleNamespace`` result objects; rebuilt as they came without your code (no constructor,
no ``__setitem__``). Anything else is a leaf: a tensor, a plain value, or an object that may hold state.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Optional

import torch

#: a container this large inside a result object is data (a table), not the tensors a call computes: not walked
_WIDE = 1024
#: containers inside containers deeper than this are leaves (a structure that holds itself ends there)
_DEEPEST = 32
_RESULTS = (UserDict, SimpleNamespace)


#: inside it a tensor's ops run torch's own code only: no ``__torch_function__`` (a tensor subclass's, a mode's)
torch_only = torch._C.DisableTorchFunction


def dispatches_to_torch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s ops run torch's own kernels (its type has no ``__torch_dispatch__`` of its own)."""
    return type(tensor) is torch.Tensor or type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__


def _node(value: Any, inside: int, depth: int) -> Optional[tuple[list[Any], Callable[[list[Any]], Any]]]:
    """``value``'s children and how to build one like it around new ones; None for a leaf.

    ``inside``: how many result objects (``UserDict``, ``SimpleNamespace``) enclose it; ``depth``: containers.
    """
    if isinstance(value, torch.Tensor) or depth >= _DEEPEST:
        return None
    # read by the built-in type's own methods: a subclass's `__iter__` or `__getitem__` is your code
    if isinstance(value, (list, tuple)):
        base: Any = tuple if isinstance(value, tuple) else list
        return list(base.__iter__(value)), lambda items: rebuilt(value, [], items)
    if isinstance(value, dict):
        keys = list(dict.keys(value))
        return list(dict.values(value)), lambda items: rebuilt(value, keys, items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        return [getattr(value, n, None) for n in names], lambda items: rebuilt(value, names, items)
    if inside < 2 and isinstance(value, _RESULTS):
        store = value.data if isinstance(value, UserDict) else vars(value)
        keys = [k for k, v in store.items() if not (isinstance(v, (list, tuple, dict)) and len(v) > _WIDE)]
        return [store[k] for k in keys], lambda items: rebuilt(value, keys, items)
    return None


def _leaves(value: Any, inside: int = 0, depth: int = 0, seen: Optional[set[int]] = None) -> Iterator[Any]:
    """Every leaf in ``value``, tensors and the rest, in order; each container walked once (``seen``: their ids).

    A structure that links back (a tree's parent links) costs what the same structure without the links does. A leaf
    held twice is given twice (a list that holds one tensor twice has two items).
    """
    if seen is not None and id(value) in seen:
        return
    try:
        node = _node(value, inside, depth)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into (a proxy whose target fails): a leaf
        node = None
    if node is None:
        yield value
        return
    seen = set() if seen is None else seen
    seen.add(id(value))
    for child in node[0]:
        yield from _leaves(child, inside + isinstance(value, _RESULTS), depth + 1, seen)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, in order, through every container :func:`_node` knows."""
    return (leaf for leaf in _leaves(value) if issubclass(type(leaf), torch.Tensor))  # type(): no `__class__` read


def values(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` as :func:`tensors` finds them, a nested tensor as its components (to read values)."""
    for tensor in tensors(value):
        yield from (tensor.unbind() if tensor.is_nested else (tensor,))


def map_tensors(
    fn: Callable[[torch.Tensor], Any],
    value: Any,
    other: Optional[Callable[[Any], Any]] = None,
    *,
    fresh: bool = False,
    _inside: int = 0,
    _depth: int = 0,
    _done: Optional[dict[int, Any]] = None,
) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (``other``, when given, to every other leaf).

    Containers are rebuilt as they came (:func:`_node`); one whose leaves all come back unchanged is ``value`` itself,
    unless ``fresh`` (a copy the caller may change). Each container is walked once: one met again maps to what it
    mapped to, one met inside itself stays as it is. A tensor held twice is mapped twice (as 0.4 did: a replay's
    copies of ``attn(q, q, q)`` stay three tensors).

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "a b")
        >>> map_tensors(lambda t: t * 2, {"x": [torch.tensor(1), Pair(torch.tensor(2), "b")]})
        {'x': [tensor(2), Pair(a=tensor(4), b='b')]}
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    done: dict[int, Any] = {} if _done is None else _done
    key = id(value)
    if key in done:
        return done[key]
    node = _node(value, _inside, _depth)
    if node is None:
        return value if other is None else other(value)
    done[key] = value  # inside itself: as it is
    inside = _inside + isinstance(value, _RESULTS)
    items = [map_tensors(fn, c, other, fresh=fresh, _inside=inside, _depth=_depth + 1, _done=done) for c in node[0]]
    made = value if not fresh and all(a is b for a, b in zip(items, node[0], strict=True)) else node[1](items)
    done[key] = made
    return made


def rebuilt(value: Any, keys: list[Any], items: list[Any]) -> Any:
    """A container like ``value`` holding ``items`` (at ``keys``: a dict's, a dataclass's fields), without your code.

    Another class than a plain one is built by its built-in base's ``__new__``, its attributes and slots copied, the
    items set by the base's own methods (a subclass's ``__setitem__`` is yours).
    """
    cls: Any = type(value)
    if cls in (list, tuple, dict):
        return dict(zip(keys, items, strict=True)) if cls is dict else cls(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return cls(*items)
    base: Any = next(t for t in (tuple, list, OrderedDict, dict, SimpleNamespace, object) if isinstance(value, t))
    made = tuple.__new__(cls, items) if base is tuple else base.__new__(cls)
    if hasattr(value, "__dict__"):
        made.__dict__.update(vars(value))
    for klass in cls.__mro__:  # a slotted dataclass's fields and the rest
        for slot in getattr(klass, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                object.__setattr__(made, slot, getattr(value, slot))
    pairs = [] if base in (tuple, list) else list(zip(keys, items, strict=True))
    if base is list:
        list.extend(made, items)
    elif base in (OrderedDict, dict):
        if isinstance(value, defaultdict):
            made.default_factory = value.default_factory
        for key, item in pairs:
            base.__setitem__(made, key, item)
        if hasattr(made, "__dict__"):  # a model output's fields follow its items
            made.__dict__.update({k: v for k, v in pairs if k in made.__dict__})
    elif isinstance(value, UserDict):
        made.__dict__["data"] = {**value.data, **dict(pairs)}
    else:
        for name, item in pairs:
            object.__setattr__(made, name, item)
    return made


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (-1 for an inference tensor, which has none and cannot be changed in place)."""
    return -1 if tensor.is_inference() else tensor._version
