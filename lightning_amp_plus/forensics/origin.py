"""Origin: where a skipped update's inf/nan were born, one typed value (standard library only).

The finder writes it, the advice rules and the skip lines read it; :meth:`Origin.to_dict` is its JSON, 0.3's keys:
``{"phase": "forward", "module": "head", "kind": "inf", "float32": "finite", "islands": ["head"]}``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Optional, Union


class Phase(str, enum.Enum):
    """Where in the step the values were born."""

    INPUT = "input"  #: the batch held them, and they reached the model (a module's inputs or the loss)
    FORWARD = "forward"  #: a module's forward (or the LightningModule's own code between module calls)
    LOSS = "loss"  #: every watched module output finite, the loss not
    BACKWARD = "backward"  #: the loss finite (and, watched, every module output)
    UNKNOWN = "unknown"  #: it could not be told (``reason`` says why)


class Verdict(str, enum.Enum):
    """What the same computation gives in another precision (``float32``, ``bf16``)."""

    FINITE = "finite"  #: finite there: the run's precision made them
    NONFINITE = "nonfinite"  #: non-finite there too: the model makes them in that precision as well
    UNKNOWN = "unknown"  #: the replay raised


class OwnCode(enum.Enum):
    """The LightningModule's own code between its module calls, as a place."""

    CODE = "the LightningModule's own code"

    def __str__(self) -> str:
        return self.value


#: ``reason``: read before the watch, which this skip starts; ``reason``: watched where it ran in float32 (an island)
WATCHING = "every module is watched from the next step"
#: an update whose last micro-batch (the one watched) had a finite loss, where an earlier one's held inf/nan
EARLIER_MICRO_BATCH = "an earlier micro-batch's loss held them; no module was named there"
IN_ISLAND = "watched in an fp32 island: float32 made them too, from the inputs it was given"
#: where an origin was born when no module made it: the step's own code (``"module": ""`` in the JSON)
OWN_CODE = OwnCode.CODE


@dataclasses.dataclass(frozen=True)
class Origin:
    """One skipped update's origin.

    Attributes:
        phase: where in the step (:class:`Phase`).
        module: the module whose forward (or backward node) made them, :data:`OWN_CODE`, or None (not named).
        kind: ``"inf"`` or ``"nan"``.
        float32: the same computation in float32 (:class:`Verdict`); ``bf16``: under bfloat16 autocast.
        islands: the modules that, run in float32, made it finite (measured); ``()``: none found; None: not measured.
        within: the call 0.3's replay could not name a module inside (read from old reports).
        op: the backward node (``SqrtBackward0``).
        fed_by: the module whose half-precision ``-inf`` the module took before it made them (a mask there, or an
            overflow to ``-inf``: a watch cannot tell; a fix runs both in float32).
        also: other modules that made ``+inf`` on their own (finite inputs) in the same update: a second tower.
        batch_too: the batch held that kind too (the step's own code may have spread the batch's).
        reason: why nothing more was told. rank: the rank that saw it born (DDP). step: the update's step.

    Example:
        >>> born = Origin(Phase.FORWARD, OWN_CODE, "inf", batch_too=True)
        >>> born.to_dict()
        {'phase': 'forward', 'module': '', 'kind': 'inf', 'batch': 'nonfinite'}
        >>> Origin.from_dict(born.to_dict()) == born
        True
    """

    phase: Phase
    module: Union[str, OwnCode, None] = None
    kind: Optional[str] = None
    float32: Optional[Verdict] = None
    bf16: Optional[Verdict] = None
    islands: Optional[tuple[str, ...]] = None
    within: Optional[str] = None
    op: Optional[str] = None
    fed_by: Optional[str] = None
    batch_too: bool = False
    reason: Optional[str] = None
    rank: Optional[int] = None
    step: Optional[int] = None
    also: tuple[str, ...] = ()  # last: a new field, the earlier fields keep their positions

    def replace(self, **change: Any) -> Origin:
        """This origin with ``change`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **change)

    but = replace  # 0.4's name, kept: an origin is public (``lightning_amp_plus.origin``)

    @property
    def own_code(self) -> bool:
        """Born in the LightningModule's own code between its module calls."""
        return self.module is OWN_CODE

    @property
    def name(self) -> str:
        """The module's name; ``""`` for the own code or no module."""
        return self.module if isinstance(self.module, str) else ""

    @property
    def where(self) -> str:
        """The place in words: the module's name, or the LightningModule's own code."""
        return str(self.module) if self.module is not None else "an unnamed module"

    @property
    def overflow(self) -> bool:
        """A forward overflow in a named module: finite in float32, measured."""
        return self.phase is Phase.FORWARD and bool(self.name) and self.float32 is Verdict.FINITE

    @property
    def observed(self) -> bool:
        """Born in a named module's forward, watched: its float32 verdict not measured."""
        return self.phase is Phase.FORWARD and bool(self.name) and self.float32 is None

    @property
    def unnamed(self) -> bool:
        """Born in forward, read from the loss before any module was watched: no place named."""
        return self.phase is Phase.FORWARD and self.module is None and self.within is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: 0.3's keys, only those that apply."""
        told: dict[str, Any] = {"phase": self.phase.value}
        if self.module is not None or self.within is not None:
            told["module"] = "" if self.module is OWN_CODE else self.module
        for key in ("within", "op", "kind", "fed_by"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key)
        for key in ("float32", "bf16"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key).value
        if self.islands is not None:
            told["islands"] = list(self.islands) or None
        if self.also:
            told["also"] = list(self.also)
        if self.batch_too:
            told["batch"] = "nonfinite"
        for key in ("reason", "rank", "step"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key)
        return told

    @classmethod
    def from_dict(cls, told: Mapping[str, Any]) -> Origin:
        """An origin from its JSON form (:meth:`to_dict`)."""
        islands = told.get("islands", False)  # absent: not measured; None: none contain it
        kept: dict[str, Any] = {k: told.get(k) for k in ("kind", "within", "op", "fed_by", "reason", "rank", "step")}
        kept.update({k: Verdict(told[k]) for k in ("float32", "bf16") if told.get(k) is not None})
        return cls(
            Phase(told.get("phase", "unknown")),
            OWN_CODE if told.get("module") == "" else told.get("module"),
            islands=None if islands is False else tuple(islands or ()),
            batch_too=told.get("batch") == "nonfinite",
            also=tuple(told.get("also") or ()),
            **kept,
        )


def unknown(reason: str) -> Origin:
    """What could not be told, with the reason."""
    return Origin(Phase.UNKNOWN, reason=reason)
