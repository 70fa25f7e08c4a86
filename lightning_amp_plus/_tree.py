"""One walk over a call's arguments: tensors mapped, containers rebuilt as they came (named tuples included)."""

from __future__ import annotations

import dataclasses
from collections import UserDict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

#: a container this large inside a result object is data (a table), not the tensors a call computes: not walked
_WIDE = 1024


def tensors(value: Any, _inside: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, in order, through lists, tuples (named ones too), dicts, dataclasses.

    Also a ``UserDict`` (transformers' ``BatchEncoding``: its ``data``, read without calling the class's code) and a
    ``SimpleNamespace`` result object, two levels deep at most (a namespace that holds itself ends there), leaving
    out containers of more than ``_WIDE`` items inside them (a table it carries).
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors(v, _inside)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v, _inside)
    elif hasattr(type(value), "__dataclass_fields__") and not isinstance(value, type):  # a dataclass instance
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name, None), _inside)
    elif _inside < 2 and isinstance(value, (UserDict, SimpleNamespace)):
        for v in (value.data if isinstance(value, UserDict) else vars(value)).values():
            if not (isinstance(v, (list, tuple, dict)) and len(v) > _WIDE):
                yield from tensors(v, _inside + 1)


def values(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` as :func:`tensors` finds them, a nested tensor as its components (to read values)."""
    for tensor in tensors(value):
        if tensor.is_nested:
            yield from tensor.unbind()
        else:
            yield tensor


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through lists, tuples, named tuples and dicts.

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "a b")
        >>> map_tensors(lambda t: t * 2, {"x": [torch.tensor(1), Pair(torch.tensor(2), "b")]})
        {'x': [tensor(2), Pair(a=tensor(4), b='b')]}
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(fn, v) for v in value]
        return rebuilt(value, items)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    return value


def rebuilt(value: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """A list or tuple of ``value``'s class holding ``items``, made without calling the user's constructor.

    A plain list or tuple, or a named tuple (its fields positionally), is built as usual; another subclass (its own
    ``__new__`` may take its fields, ``Pair(out, aux)``, or take an iterable and mean something else) is made by
    ``tuple.__new__`` / ``list.__new__`` with ``value``'s attributes copied.

    Example:
        >>> class Pair(tuple):
        ...     def __new__(cls, a, b=None):
        ...         return super().__new__(cls, (a, b))
        >>> made = rebuilt(Pair(1, 2), [3, 4])
        >>> type(made).__name__, tuple(made)
        ('Pair', (3, 4))
    """
    cls: Any = type(value)
    if cls is tuple or cls is list:
        return cls(items)
    if hasattr(value, "_fields"):
        return cls(*items)
    if isinstance(value, tuple):
        made = tuple.__new__(cls, items)
    else:
        made = list.__new__(cls)
        list.extend(made, items)
    if hasattr(value, "__dict__"):
        made.__dict__.update(vars(value))
    return made


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (-1 for an inference tensor, which has none and cannot be changed in place)."""
    return -1 if tensor.is_inference() else tensor._version
