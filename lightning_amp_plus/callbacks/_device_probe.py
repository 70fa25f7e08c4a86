"""What a skip a fused optimizer decided on the device can tell, read one batch late at most and without a sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import Tensor

from lightning_amp_plus.callbacks._skip_text import skip_record
from lightning_amp_plus.forensics.observe import BatchRecord
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.syncs import FlagPeek


class _Read:
    """A flag the history read already, held as a :class:`FlagPeek` is (its value is on the host)."""

    __slots__ = ("_value",)

    def __init__(self, value: float) -> None:
        self._value = value

    def value(self, wait: bool = False) -> float:
        return self._value


class DeviceSkipProbe:
    """Holds a device-decided update's flag copy and its batch until the flag is on the host, then tells of it.

    After such a batch, :meth:`hold` starts a non-blocking copy of the flag; :meth:`look` (at the next batch start, or
    ``wait=True`` at the end of fit) reads it once it arrived and, on a skip, asks ``read`` what it can tell of it
    (the reporter: the batch's origin, the offending gradients), kept until the skip is reported (:meth:`take`). A
    later batch's flag replaces one still in flight.
    """

    def __init__(self) -> None:
        # a flag in flight (or read already), with its batch
        self.held: Optional[tuple[int, FlagPeek | _Read, Optional[BatchRecord]]] = None
        self._probed_upto = -1  # the last update whose flag was held
        self._told: dict[int, Any] = {}

    @property
    def held_step(self) -> Optional[int]:
        """The step whose flag is still in flight (its skip waits for its origin), or None."""
        return None if self.held is None else self.held[0]

    def hold(self, history: ScaleHistory, calls: Optional[BatchRecord]) -> None:
        """After a batch: copy its update's flag without waiting, with the batch's ``calls`` for the origin."""
        last = history.last_flag()
        if last is None or last[0] <= self._probed_upto:
            return  # this (micro-)batch recorded no update: the last flag is an earlier batch's
        step, found = last
        self._probed_upto = step
        if isinstance(found, Tensor):
            self.held = (step, FlagPeek(found), calls)
        elif found > 0:  # read on the host already (another callback flushed the history first): told at once
            self.held = (step, _Read(float(found)), calls)

    def look(self, read: Callable[[Optional[BatchRecord], int], Any], wait: bool) -> Optional[int]:
        """Tell the held batch's origin if its flag is on the host (``wait``: read it anyway).

        Returns the step whose skip was just read (its record can be made now), or None.
        """
        if self.held is None:
            return None
        step, peek, calls = self.held
        flag = peek.value(wait=wait)
        if flag is None:
            return None
        self.held = None
        if flag > 0:
            self._told[step] = read(calls, step)
            return step
        return None

    def records(
        self,
        history: ScaleHistory,
        after: int,
        known: set[int],
        upto: Optional[int],
        scale_now: Optional[Callable[[], float]] = None,
        scaled: bool = True,
    ) -> tuple[list[tuple[dict[str, Any], int]], int]:
        """The skips in ``history`` after ``after``, not ``known``, up to ``upto``: records with streaks, last step.

        Those a fused optimizer decided on the device; ``upto`` default: all (a held flag's step waits for it).
        ``scale_now``: the scaler's scale, read once the last recorded step's update is done (its new scale).
        """
        recorded = history.last_step if history.last_step is not None else -1
        last = recorded if upto is None else min(recorded, upto)
        if self.held_step is not None:
            last = min(last, self.held_step - 1)
        if last <= after:
            return [], after
        found = []
        for step in history.skipped_between(after + 1, last):
            if step not in known:
                new_scale = (
                    history.scale_at(step + 1) if step < recorded else scale_now() if scale_now is not None else None
                )
                told = self.take(step) or {}  # when its flag was read (nothing: it came too late)
                record = skip_record(step, history.scale_at(step), new_scale, told, scaled)
                found.append((record, history.streak_at(step)))
        return found, last

    def drop(self) -> None:
        """Let the flag in flight go (with the batch it holds)."""
        self.held = None

    def take(self, step: int) -> Any:
        """What ``read`` said of ``step``'s skip (None: its flag was not read in time)."""
        return self._told.pop(step, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(held_step={self.held_step}, told={sorted(self._told)})"
