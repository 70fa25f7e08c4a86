"""A callback's per-fit state, declared once: ``reset``, ``state_dict`` and ``load_state_dict`` all read one table.

torchmetrics' ``add_state`` in small: a field added here lives as ``self._<name>``; :meth:`DeclaredState.reset`
gives every field a fresh default, and the persistent ones go into and come back from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class _Field:
    default: Any  # a value, or a callable that makes one (picklable: callbacks travel to spawned processes)
    save: Callable[[Any], Any]
    load: Callable[[Any], Any]
    persistent: bool

    def fresh(self) -> Any:
        return self.default() if callable(self.default) else self.default


def _same(value: Any) -> Any:
    return value


class DeclaredState:
    """Mixin: per-fit state declared with :meth:`add_state` in ``__init__``, then reset, saved and loaded alike.

    Example:
        >>> class Counter(DeclaredState):
        ...     def __init__(self):
        ...         self._seen = self.add_state("seen", 0)
        ...         self._cache = self.add_state("cache", dict, persistent=False)
        >>> counter = Counter()
        >>> counter._seen = 3
        >>> state = counter.state_dict()
        >>> counter.reset(); counter._seen
        0
        >>> counter.load_state_dict(state); counter._seen, state
        (3, {'seen': 3})
    """

    _fields: dict[str, _Field]

    def add_state(
        self,
        name: str,
        default: Any,
        *,
        save: Optional[Callable[[Any], Any]] = None,
        load: Optional[Callable[[Any], Any]] = None,
        persistent: bool = True,
    ) -> Any:
        """Declare ``self._<name>`` and return its first value (assign it: ``self._seen = self.add_state(...)``).

        Args:
            name: the checkpoint key; the attribute is ``_<name>``.
            default: the value after :meth:`reset`; a callable (a class, a lambda) makes a fresh one each time.
            save: value -> what the checkpoint holds (default: the value itself).
            load: what the checkpoint holds -> value (default: a scalar default's type, else as it is).
            persistent: whether the field is saved (False: reset per fit only).
        """
        if not hasattr(self, "_fields"):
            self._fields = {}
        if load is None:
            load = type(default) if isinstance(default, (int, float, bool)) else _same
        field = self._fields[name] = _Field(default, save or _same, load, persistent)
        return field.fresh()

    def reset(self) -> None:
        """Every declared field back to its default (a new fit calls this; a resumed fit then loads its checkpoint)."""
        for name, spec in self._fields.items():
            setattr(self, f"_{name}", spec.fresh())

    def state_dict(self) -> dict[str, Any]:
        return {name: spec.save(getattr(self, f"_{name}")) for name, spec in self._fields.items() if spec.persistent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the persistent fields; a key the checkpoint lacks (an older version's) takes its default."""
        for name, spec in self._fields.items():
            if spec.persistent:
                setattr(self, f"_{name}", spec.load(state_dict[name]) if name in state_dict else spec.fresh())
