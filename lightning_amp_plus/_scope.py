"""What a fit's state belongs to: a new Trainer starts afresh, another fit of the same Trainer continues."""

from __future__ import annotations

import weakref
from typing import Any, Optional


class FitScope:
    """Tells a new run from another ``fit`` of the same Trainer.

    A plugin or callback reused with a new Trainer starts afresh; ``trainer.fit`` called again on the same Trainer
    continues, as Lightning's own step counters do (and a resumed fit then loads its checkpoint on top).

    Example:
        >>> class Trainer: ...
        >>> scope, first, second = FitScope(), Trainer(), Trainer()
        >>> scope.starts_afresh(first), scope.starts_afresh(first), scope.starts_afresh(second)
        (True, False, True)
    """

    def __init__(self) -> None:
        self._trainer: Optional[weakref.ref] = None

    def starts_afresh(self, trainer: Any) -> bool:
        """Whether a fit with ``trainer`` is a new run (and remember ``trainer`` for the next call)."""
        previous = self._trainer() if self._trainer is not None else None
        self._trainer = weakref.ref(trainer)
        return previous is not trainer

    def __getstate__(self) -> dict[str, Any]:
        # a copy in another process (spawn, pickle) holds no Trainer of this one: its next fit starts afresh
        return {"_trainer": None}
