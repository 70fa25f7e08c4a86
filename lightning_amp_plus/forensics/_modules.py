"""The one module walker: which modules the watch, the replay and the reruns see, what each is called, how it runs.

Torch only. :func:`walk` visits every module under a model once (a module reached by two names keeps its first, as
``named_modules()`` does), with the name every report uses (``torch.compile``'s ``_orig_mod.`` dropped) and how it
runs (:class:`How`). :func:`call_frontier` is the same walk seen from one module: the modules its own code calls.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import NamedTuple

import torch

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper


class How(enum.Enum):
    """How a module runs, as far as a hook can see."""

    EAGER = "eager"  #: Python calls it: its hooks run
    COMPILED = "compiled"  #: a ``torch.compile`` wrapper: its inside runs in its graph (watched as one)
    IN_PLACE = "compiled in place"  #: ``module.compile()``: its own hooks are traced, its caller sees it
    SCRIPTED = "scripted"  #: ``torch.jit``: no Python hook runs inside it
    INSIDE = "inside"  #: inside a compiled or scripted module: never called by Python


class Seen(NamedTuple):
    """One module as the walk sees it."""

    name: str
    module: torch.nn.Module
    how: How


def how(module: torch.nn.Module) -> How:
    """How ``module`` itself runs (not what encloses it)."""
    if is_compiled_wrapper(module):
        return How.COMPILED
    if isinstance(module, torch.jit.ScriptModule):
        return How.SCRIPTED
    if getattr(module, "_compiled_call_impl", None) is not None:
        return How.IN_PLACE
    return How.EAGER


def walk(model: torch.nn.Module) -> Iterator[Seen]:
    """Every module under ``model`` (not ``model`` itself), once, in ``named_modules()`` order.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Sequential(nn.ReLU())))
        >>> [(s.name, s.how.value) for s in walk(net)]
        [('0', 'eager'), ('1', 'scripted'), ('1.0', 'inside')]
    """
    inside: set[int] = set()
    for raw, module in model.named_modules():
        if not raw or module is model:
            continue
        if id(module) in inside:
            yield Seen(clean_name(raw), module, How.INSIDE)
            continue
        kind = how(module)
        if kind is How.COMPILED:
            inside.update(id(m) for m in module._orig_mod.modules())  # type: ignore[operator]
        elif kind in (How.SCRIPTED, How.IN_PLACE):
            inside.update(id(m) for m in module.modules() if m is not module)
        yield Seen(clean_name(raw), module, kind)


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
        kind = how(child)
        container = (
            kind in (How.EAGER, How.IN_PLACE)
            and type(child).forward is torch.nn.Module.forward
            and "forward" not in vars(child)
        )
        if container:
            yield from call_frontier(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child
