"""Origin: where a skipped update's inf/nan were born, as one typed value (standard library only).

:class:`~lightning_amp_plus.origins.OriginFinder` and the opt-in reruns write it, the advice rules and the skip
lines read it, and :meth:`Origin.to_dict` is its JSON (a skip record's ``origin``, the advisor's figures), with the
keys 0.3 wrote: ``{"phase": "forward", "module": "head", "kind": "inf", "float32": "finite", "islands": ["head"]}``.
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
    LOSS = "loss"  #: every recorded module output finite, the loss not
    BACKWARD = "backward"  #: forward and loss finite
    UNKNOWN = "unknown"  #: it could not be told (``reason`` says why)


class Verdict(str, enum.Enum):
    """What the same computation gives in another precision (``float32``, ``bf16``), measured by replay or rerun."""

    FINITE = "finite"  #: finite there: the run's precision made them
    NONFINITE = "nonfinite"  #: non-finite there too: the model makes them in that precision as well
    UNKNOWN = "unknown"  #: the replay raised


class OwnCode(enum.Enum):
    """The LightningModule's own code between its module calls (which no replay reads), as a place."""

    CODE = "the LightningModule's own code"

    def __str__(self) -> str:
        return self.value


#: where an origin was born when no module made it: the step's own code (``"module": ""`` in the JSON)
OWN_CODE = OwnCode.CODE


@dataclasses.dataclass(frozen=True)
class Origin:
    """One skipped update's origin.

    Attributes:
        phase: where in the step (:class:`Phase`).
        module: the module whose forward (or backward node) made them, :data:`OWN_CODE`, or None when not named
            (a replay that computed other values: ``within`` names the call, ``reason`` says why).
        kind: ``"inf"`` or ``"nan"``.
        float32: the same computation in float32 (:class:`Verdict`); ``bf16``: under bfloat16 autocast.
        islands: the modules that, run in float32, made it finite (measured); ``()``: no such set was found;
            None: not measured.
        within: the module call a replay could not name the module inside.
        op: the backward node (``SqrtBackward0``).
        batch_too: the batch held that kind too (the step's own code may have spread the batch's).
        reason: why it is unknown, or why a rerun told nothing more.
        rank: the rank that saw it born (DDP). step: the update's step (the advisor's figures).

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
    batch_too: bool = False
    reason: Optional[str] = None
    rank: Optional[int] = None
    step: Optional[int] = None

    def but(self, **change: Any) -> Origin:
        """This origin with ``change`` applied."""
        return dataclasses.replace(self, **change)

    @property
    def own_code(self) -> bool:
        """Born in the LightningModule's own code between its module calls."""
        return self.module is OWN_CODE

    @property
    def name(self) -> str:
        """The module's name; ``""`` for the own code or no module (as the JSON writes it)."""
        return self.module if isinstance(self.module, str) else ""

    @property
    def where(self) -> str:
        """The place in words: the module's name, or the LightningModule's own code."""
        return str(self.module) if self.module is not None else "an unnamed module"

    @property
    def overflow(self) -> bool:
        """A forward overflow in a named module: finite in float32."""
        return self.phase is Phase.FORWARD and bool(self.name) and self.float32 is Verdict.FINITE

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: 0.3's keys, only those that apply."""
        told: dict[str, Any] = {"phase": self.phase.value}
        if self.module is not None or self.within is not None:
            told["module"] = "" if self.module is OWN_CODE else self.module
        for key in ("within", "op", "kind"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key)
        for key in ("float32", "bf16"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key).value
        if self.islands is not None:
            told["islands"] = list(self.islands) or None
        if self.batch_too:
            told["batch"] = "nonfinite"
        for key in ("reason", "rank", "step"):
            if getattr(self, key) is not None:
                told[key] = getattr(self, key)
        return told

    @classmethod
    def from_dict(cls, told: Mapping[str, Any]) -> Origin:
        """An origin from its JSON form (:meth:`to_dict`)."""
        module = told.get("module")
        islands = told.get("islands", False)  # absent: not measured; None: none contain it

        def verdict(key: str) -> Optional[Verdict]:
            return Verdict(told[key]) if told.get(key) is not None else None

        return cls(
            Phase(told.get("phase", "unknown")),
            OWN_CODE if module == "" else module,
            told.get("kind"),
            verdict("float32"),
            verdict("bf16"),
            islands=None if islands is False else tuple(islands or ()),
            within=told.get("within"),
            op=told.get("op"),
            batch_too=told.get("batch") == "nonfinite",
            reason=told.get("reason"),
            rank=told.get("rank"),
            step=told.get("step"),
        )


def unknown(reason: str) -> Origin:
    """The told outcome of a replay that could not tell (it raised, or the step changed what it needs)."""
    return Origin(Phase.UNKNOWN, reason=reason)
