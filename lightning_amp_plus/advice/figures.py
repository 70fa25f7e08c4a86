"""Readings of the figures that rules of more than one family share (each family's own helpers sit beside it)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_amp_plus.advice.registry import RunFigures
from lightning_amp_plus.forensics.origin import Origin, Phase, Verdict

#: an underflow fraction from which the gradients count as losing much to fp16 (GradUnderflowMonitor's default)
HIGH_UNDERFLOW = 0.5


def most(count: int, total: int, *, least: int = 1, half: bool = False) -> bool:
    """The one majority test of the rules: ``count`` of ``total`` more than half, and at least ``least``.

    ``half``: at least half.

    Example:
        >>> most(2, 3), most(2, 4), most(2, 4, half=True), most(1, 1, least=2)
        (True, False, True, False)
    """
    return count >= least and total > 0 and (2 * count >= total if half else 2 * count > total)


def _known_origins(figures: RunFigures, unnamed: bool = False) -> list[Origin]:
    """The told origins, typed (the figures hold their JSON form); ``unnamed``: with those read from the loss alone.

    A forward origin read before the watch named a place (the first such skip) tells a phase, not a place: the
    rules that weigh places leave it out.
    """
    typed = [Origin.from_dict(o) for o in figures.origins or [] if o]
    return typed if unnamed else [o for o in typed if not o.unnamed]


def told_skips(figures: RunFigures, told: int) -> str:
    """``told`` skipped updates in words, with the run's count where it skipped more than were told.

    Example:
        >>> told_skips(RunFigures(skipped=[0, 1, 2]), 3), told_skips(RunFigures(skipped=[0, 1, 2]), 1)
        ('3 skipped updates', '1 skipped update told (3 skipped in all)')
    """
    total = len(figures.skipped) if figures.skipped is not None else told
    said = f"{told} skipped update{'' if told == 1 else 's'}"
    return f"{said} told ({total} skipped in all)" if total > told else said


def _origins_measured(figures: RunFigures) -> bool:
    """Whether the run's origins were told (live); offline a log holds none."""
    return figures.origins is not None


def _knobs_known(figures: RunFigures) -> bool:
    """Whether the run's scaler knobs are known (live, or its plugin call logged at a fit from step 0)."""
    return figures.knobs is not None


def _scaling_skips(figures: RunFigures) -> list[int]:
    """The skipped steps a loss scale could have avoided.

    All but those born in the batch, the loss or a forward, and those whose float32 replay is non-finite too (a
    backward that makes inf/nan at any scale). Offline, those whose loss the reporter logged inf/nan.
    """
    not_scaling = {
        o.step
        for o in _known_origins(figures, unnamed=True)
        if o.step is not None
        and (o.phase in (Phase.INPUT, Phase.LOSS, Phase.FORWARD) or o.float32 is Verdict.NONFINITE)
    }
    not_scaling.update(figures.loss_nonfinite or ())
    return [s for s in figures.skipped or [] if s not in not_scaling]


def _underflow_measured(figures: RunFigures) -> bool:
    return figures.underflow is not None


def _high_underflow(figures: RunFigures) -> list[dict[str, Any]]:
    return [m for m in _measured(figures) if m["underflow_fraction"] >= HIGH_UNDERFLOW]


def _measured(figures: RunFigures) -> list[dict[str, Any]]:
    """The measurements with an underflow figure (an overflowed or all-zero update has none)."""
    return [m for m in figures.underflow or [] if m.get("underflow_fraction") is not None]


def _leading_row(figures: RunFigures) -> tuple[int, int]:
    """The skips a loss scale could have avoided in a row from the run's first update, and the step after the row.

    A skip in the row no loss scale causes (born in the batch, a forward or the loss) is stepped over, uncounted: the
    scale still settles around it.
    """
    if not figures.skipped or not figures.curve:
        return 0, figures.curve[0][0] if figures.curve else 0
    step, skipped, scaling = figures.curve[0][0], set(figures.skipped), set(_scaling_skips(figures))
    count = 0
    while step in skipped:
        count += step in scaling
        step += 1
    return count, step


def fitting_scale(measurement: dict[str, Any]) -> Optional[tuple[float, float]]:
    """From a float32 reference: the largest scale that fits, and what float16 would still lose there.

    ``GradUnderflowMonitor`` measures both: the largest power of two that keeps the largest true gradient (at the
    weights and at each module's output) a doubling below float16's overflow, and the fraction of the non-zero true
    weight gradient elements still below float16's smallest normal at it. None without a reference.

    Example:
        >>> fitting_scale({"fitting_scale": 2.0**54, "lost_at_fitting_scale": 0.1})
        (1.8014398509481984e+16, 0.1)
    """
    if measurement.get("fitting_scale") is None:
        return None
    return measurement["fitting_scale"], measurement["lost_at_fitting_scale"]


def _referenced(figures: RunFigures) -> list[tuple[dict[str, Any], tuple[float, float]]]:
    """The high-underflow measurements that have a float32 reference, with their fitting scale."""
    found = []
    for m in _high_underflow(figures):
        fit = fitting_scale(m)
        if fit is not None:
            found.append((m, fit))
    return found
