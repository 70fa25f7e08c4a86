"""What users hold, resolved to what we act on, by type (torch only).

The optimizer inside Lightning's and Fabric's wrappers; the module inside Fabric's, DDP's and ``torch.compile``'s.
Resolution is by type, and only for the wrappers we know: a user's own wrapper (a Lookahead-style optimizer that
keeps its inner optimizer in ``_optimizer``, say) is an optimizer in its own right, and its ``step()`` is the one
that runs. The wrapper types are looked up in ``sys.modules`` instead of imported: a wrapper of a module that was
never imported cannot exist, so this module needs neither Lightning nor Fabric.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

#: (module, class, attribute holding what it wraps): Lightning's and Fabric's optimizer wrappers (the user's optimizer
#: in ``_optimizer``), Fabric's, compile's and DDP's module wrappers (the user's module)
_WRAPPERS = (
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("lightning.fabric.wrappers", "_FabricOptimizer", "_optimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("lightning_fabric.wrappers", "_FabricOptimizer", "_optimizer"),
    ("lightning.fabric.wrappers", "_FabricModule", "_original_module"),
    ("lightning_fabric.wrappers", "_FabricModule", "_original_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
)


def _imported(module_name: str, class_name: str) -> type | None:
    """The class if its module is imported already and has it; ``None`` if not (never imports anything)."""
    return getattr(sys.modules.get(module_name), class_name, None)


#: per type, where it keeps what it wraps. Exact and never stale: a wrapper's instance exists only once its module
#: is imported, and a type's bases never change. Keyed by weak references (equal when their types are, looked up
#: in C): Lightning and Fabric make a class per wrapper instance, and an entry goes with its class.
_INNER: dict[weakref.ref[type], str | None] = {}
_UNSEEN = object()


def _inner_attribute(cls: type) -> str | None:
    """Where a wrapper of type ``cls`` keeps what it wraps (``None``: not a wrapper we know); one lookup when known."""
    attribute = _INNER.get(weakref.ref(cls), _UNSEEN)
    if attribute is _UNSEEN:
        attribute = next(
            (attribute for module, name, attribute in _WRAPPERS if issubclass(cls, _imported(module, name) or ())),
            None,
        )
        _INNER[weakref.ref(cls, _forget)] = attribute
    return attribute  # type: ignore[return-value]


def _forget(key: weakref.ref[type]) -> None:
    _INNER.pop(key, None)


def resolve_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` or Fabric's ``_FabricOptimizer`` (nested too).

    Any other object is returned as it is: a user's wrapper is the optimizer that steps.

    Example:
        >>> import torch
        >>> from lightning.pytorch.core.optimizer import LightningOptimizer
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> resolve_optimizer(LightningOptimizer(opt)) is opt, resolve_optimizer(opt) is opt
        (True, True)
        >>> class Lookahead(torch.optim.Optimizer):  # a user's wrapper: an optimizer in its own right
        ...     def __init__(self, inner):
        ...         self._optimizer = inner
        >>> wrapper = Lookahead(opt)
        >>> resolve_optimizer(wrapper) is wrapper
        True
    """
    while True:
        attribute = _INNER.get(weakref.ref(type(optimizer)), _UNSEEN)  # the common case without a call
        if attribute is _UNSEEN:
            attribute = _inner_attribute(type(optimizer))
        if attribute != "_optimizer":
            return optimizer
        optimizer = optimizer._optimizer


#: name segments that wrappers insert between the user's modules: FSDP1, activation checkpointing, torch.compile
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule`` (by type; torch's dynamo need not be imported)."""
    return _inner_attribute(type(module)) == "_orig_mod"


def clean_name(name: str) -> str:
    """A module or parameter name as the user wrote it: without FSDP's, checkpointing's or compile's segments.

    The one rule for every name the package reports (offenders, rows, islands, worst parameters).

    Example:
        >>> clean_name("model._orig_mod.bert._fsdp_wrapped_module.embeddings.LayerNorm.weight")
        'model.bert.embeddings.LayerNorm.weight'
    """
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def resolve_module(module: Any) -> Any:
    """The user's module inside Fabric's ``_FabricModule``, ``torch.compile``'s ``OptimizedModule`` and DDP (nested).

    Parameter and module names taken from the result are the ones the user wrote.
    """
    while True:
        attribute = _inner_attribute(type(module))
        if attribute is None or attribute == "_optimizer":
            return module
        module = getattr(module, attribute)
