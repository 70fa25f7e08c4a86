"""Logged series read back (standard library only): the rules the plot and the ``advise`` command share."""

from __future__ import annotations

from typing import Optional

Series = dict[str, list[tuple[int, float]]]


def value_at(curve: list[tuple[int, float]], step: int) -> float:
    """The value of a step function given by its change points ``[(step, value)]`` at ``step``.

    Example:
        >>> value_at([(0, 4.0), (5, 2.0)], 4), value_at([(0, 4.0), (5, 2.0)], 5)
        (4.0, 2.0)
    """
    value = curve[0][1]
    for s, v in curve:
        if s > step:
            break
        value = v
    return value


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
