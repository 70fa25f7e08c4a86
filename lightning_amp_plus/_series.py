"""Logged series read back (standard library only): the rules the plot and the ``advise`` command share."""

from __future__ import annotations

import bisect
import math
from typing import Optional

from lightning_amp_plus._limits import FLOAT32_MAX

Series = dict[str, list[tuple[int, float]]]


def scale_key(series: Series) -> Optional[str]:
    """The logged loss-scale series' key (``amp/loss_scale``, any prefix), or None (bf16, or not logged)."""
    return next((k for k in series if k.endswith("loss_scale") and "log2" not in k), None)


def prefix_of(key: str) -> str:
    """The metric prefix of a loss-scale key: ``"amp/"`` for ``"amp/loss_scale"``."""
    return key[: -len("loss_scale")]


def scale_changes(series: Series, key: str) -> list[tuple[int, float]]:
    """The change points ``[(step, scale)]`` of the logged scale; a value no float32 scale can hold is an error.

    Example:
        >>> scale_changes({"amp/loss_scale": [(2, 4.0), (0, 8.0), (1, 8.0)]}, "amp/loss_scale")
        [(0, 8.0), (2, 4.0)]
    """
    points = sorted(series[key])
    changes: list[tuple[int, float]] = []
    for step, value in points:
        if not 0 < value <= FLOAT32_MAX:  # a float32 scale, subnormal ones included (a stock scaler has no floor)
            raise ValueError(
                f"{key} at step {step} is {value!r}: not a loss scale (expected a float32 scale in"
                f" (0, {FLOAT32_MAX!r}])."
            )
        if not changes or value != changes[-1][1]:
            changes.append((step, value))
    return changes


def value_at(curve: list[tuple[int, float]], step: int) -> float:
    """The value at ``step`` of a step function given by its sorted change points ``[(step, value)]``.

    The one curve lookup of the package (history, monitor, plot, advice). A step before the first point reads the
    first value.

    Example:
        >>> value_at([(0, 4.0), (5, 2.0)], 4), value_at([(0, 4.0), (5, 2.0)], 5), value_at([(3, 4.0)], 1)
        (4.0, 2.0, 4.0)
    """
    index = bisect.bisect_right(curve, (step, math.inf))  # the first point after `step`
    return curve[max(index - 1, 0)][1]


def held(curve: list[tuple[int, float]], last_step: Optional[int]) -> list[tuple[int, float]]:
    """``curve`` with its last value held to ``last_step``: a step function read or drawn to the run's end.

    Example:
        >>> held([(0, 8.0), (3, 4.0)], 9), held([(0, 8.0), (3, 4.0)], 3)
        ([(0, 8.0), (3, 4.0), (9, 4.0)], [(0, 8.0), (3, 4.0)])
    """
    if curve and last_step is not None and curve[-1][0] < last_step:
        return [*curve, (last_step, curve[-1][1])]
    return list(curve)


def skipped_steps(series: Series, prefix: str) -> Optional[list[int]]:
    """The skipped steps a run logged: ``step_skipped`` marks (NaNSkipReporter), else where ``skipped_steps`` rose.

    ``None`` when neither was logged (a stock plugin's sampled curve).

    Example:
        >>> skipped_steps({"amp/skipped_steps": [(0, 0.0), (3, 1.0), (4, 1.0), (9, 2.0)]}, "amp/")
        [3, 9]
    """
    marked = series.get(prefix + "step_skipped")
    if marked:
        return sorted({s for s, v in marked if v})
    counts = series.get(prefix + "skipped_steps")
    if counts is None:
        return None
    found, count = [], 0.0
    for step, value in sorted(counts):
        if value > count:
            found.append(step)
            count = value
    return found


def logged_updates(series: Series, prefix: str, skipped: Optional[list[int]], first: int, last: int) -> int:
    """How many updates a log from step ``first`` to ``last`` covers.

    ``LossScaleMonitor``'s counts at the last step they were logged, where every skip they count is in the log (a
    fit logged from its first update, or a ``to_csv`` export); else the steps' span (a resumed run's log counts
    updates it does not hold).

    Example:
        >>> series = {"amp/applied_steps": [(1, 2.0), (3, 2.0)], "amp/skipped_steps": [(1, 0.0), (3, 2.0)]}
        >>> logged_updates(series, "amp/", [2, 3], first=1, last=3)  # the log starts at its first logging point
        4
    """
    applied = dict(series.get(prefix + "applied_steps", []))
    if applied and skipped is not None:
        step = max(applied)
        told = sum(1 for s in skipped if s <= step)
        counted = dict(series.get(prefix + "skipped_steps", [])).get(step)
        if counted is None or counted == told:
            return int(applied[step]) + told + (last - step)
    return last - first + 1
