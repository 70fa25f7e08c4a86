"""The package's warning category: a misconfiguration or a fault the user should act on.

Informational lines (skipped steps, summaries, what a checkpoint changed) go to the ``lightning_amp_plus`` logger
instead. The test suite turns ``AmpPlusWarning`` into an error, so no test passes while the package says something
is wrong.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

from lightning_amp_plus._log import global_rank


class AmpPlusWarning(UserWarning):
    """Something is wrong or suspicious in how mixed precision is used (the message says what, and the fix)."""


#: top-level modules whose frames are not the user's (the package, Lightning, torch, and the standard library's
#: wrappers they run the user's code through): a warning points past them, at the line that led there
_LIBRARIES = frozenset(
    {"lightning_amp_plus", "lightning", "lightning_fabric", "pytorch_lightning", "torch", "contextlib", "functools"}
)


def warn_at_user(message: str) -> None:
    """``warnings.warn(message, AmpPlusWarning)`` from rank zero, attributed to the user's line that led here.

    That is the first frame outside the package, Lightning and torch: ``trainer.fit(...)``, ``fabric.backward(...)``
    or ``self.manual_backward(...)``.
    """
    if global_rank() != 0:
        return
    frame = sys._getframe(1)  # the caller: `stacklevel=2`
    level = 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame = frame.f_back
        level += 1
    warnings.warn(message, AmpPlusWarning, stacklevel=level)


def deprecated(old: str, new: str) -> None:
    """Warn that ``old`` (0.2's) is deprecated, at the user's line (the caller's caller), naming ``new``."""
    warnings.warn(f"`{old}` is deprecated since 0.3 and goes in 0.4: use {new}.", DeprecationWarning, stacklevel=3)


def moved(here: str, table: dict[str, str], goes: str) -> Callable[[str], Any]:
    """A module's ``__getattr__`` for names that moved: each read warns at the user's line, gives the new object.

    ``table`` maps each name to its new module; ``goes``: the release the old path goes in.
    """

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {here!r} has no attribute {name!r}")
        warnings.warn(
            f"`{here}.{name}` moved to `{table[name]}.{name}`; the old path goes in {goes}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(table[name]), name)

    return __getattr__
