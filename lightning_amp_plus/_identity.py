"""What users hold, resolved to what we act on, by type (torch only).

The optimizer inside Lightning's and Fabric's wrappers; the module inside Fabric's, DDP's and ``torch.compile``'s.
Resolution is by type, and only for the wrappers we know: a user's own wrapper (a Lookahead-style optimizer that
keeps its inner optimizer in ``_optimizer``, say) is an optimizer in its own right, and its ``step()`` is the one
that runs. The wrapper types are looked up in ``sys.modules`` instead of imported: a wrapper of a module that was
never imported cannot exist, so this module needs neither Lightning nor Fabric.
"""

from __future__ import annotations

import sys
from typing import Any

#: (module, class) of every optimizer wrapper that keeps the user's optimizer in ``_optimizer``
_OPTIMIZER_WRAPPERS = (
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"),
    ("lightning.fabric.wrappers", "_FabricOptimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"),
    ("lightning_fabric.wrappers", "_FabricOptimizer"),
)
#: (module, class, attribute holding the user's module)
_MODULE_WRAPPERS = (
    ("lightning.fabric.wrappers", "_FabricModule", "_original_module"),
    ("lightning_fabric.wrappers", "_FabricModule", "_original_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
)


def _types(table: tuple[tuple[str, ...], ...]) -> tuple[type, ...]:
    found = []
    for module_name, class_name, *_ in table:
        cls = getattr(sys.modules.get(module_name), class_name, None)  # None where the module is not imported
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


#: per type: whether it is one of the optimizer wrappers. Exact and never stale: a wrapper's instance exists only
#: once its module is imported, and a type's bases never change.
_IS_OPTIMIZER_WRAPPER: dict[type, bool] = {}


def _is_optimizer_wrapper(cls: type) -> bool:
    known = _IS_OPTIMIZER_WRAPPER.get(cls)
    if known is None:
        wrappers = _types(_OPTIMIZER_WRAPPERS)
        known = _IS_OPTIMIZER_WRAPPER[cls] = bool(wrappers) and issubclass(cls, wrappers)
    return known


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
    for _ in range(8):  # wrappers of wrappers, bounded; a plain optimizer costs one dict lookup
        if not _is_optimizer_wrapper(type(optimizer)):
            return optimizer
        optimizer = optimizer._optimizer
    return optimizer


#: name segments that wrappers insert between the user's modules: FSDP1, activation checkpointing, torch.compile
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule`` (by type; torch's dynamo need not be imported)."""
    cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)  # None: not imported
    return isinstance(cls, type) and isinstance(module, cls)


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
    table = [(m, c, a) for m, c, a in _MODULE_WRAPPERS if m in sys.modules]
    for _ in range(8):
        for module_name, class_name, attribute in table:
            cls = getattr(sys.modules[module_name], class_name, None)
            if isinstance(cls, type) and isinstance(module, cls):
                module = getattr(module, attribute)
                break
        else:
            return module
    return module
