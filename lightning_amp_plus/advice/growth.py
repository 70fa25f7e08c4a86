"""The loss scale's motion: ``growth_interval``, ``hysteresis`` and ``skip_rate`` (what a healthy scaler does)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from lightning_amp_plus._limits import scale_floor
from lightning_amp_plus._series import value_at
from lightning_amp_plus.advice.figures import (
    _knobs_known,
    _known_origins,
    _leading_row,
    _measured,
    _scaling_skips,
)
from lightning_amp_plus.advice.fix import _scale, plugin_fix
from lightning_amp_plus.advice.registry import Advice, RunFigures, rule
from lightning_amp_plus.forensics.origin import EARLIER_MICRO_BATCH, Phase

#: clean updates after a backoff with no growth before the growth interval is worth advice
MIN_UPDATES_AFTER_BACKOFF = 50


#: isolated overflows (each halving the scale, with regrowth in between) before hysteresis is worth advice
MIN_ISOLATED_BACKOFFS = 3


#: mean underflow fraction after a backoff from which the lower scale costs gradient bits (growth_interval)
GROWTH_UNDERFLOW = 0.05


#: skip rate from which a run that no other code explains is reported (skip_rate)
HIGH_SKIP_RATE = 0.5
#: skip rate after the leading skips from which a run is never healthy (a saw-tooth that short wastes them)
SETTLED_SKIP_RATE = 0.25


#: skipped updates in a row at the end of a run from which it is reported (skip_rate): it ended training on nothing
TRAILING_STREAK = 3


def _changes(curve: list[tuple[int, float]]) -> list[tuple[int, float, float]]:
    """``(step, before, after)`` for each change of the scale."""
    return [(s, a, b) for (_, a), (s, b) in zip(curve, curve[1:], strict=False) if b != a]


@rule(
    "growth_interval",
    evidence="After a backoff past the calibration, the scale did not grow back in 50+ clean updates, while "
    "5%+ of the true gradient was lost at the lower scale.",
    fix="`growth_interval=` a quarter of those updates, rounded to 1, 2 or 5 x 10^k.",
    look_alike="A scale that grew back.",
)
def _growth_interval(figures: RunFigures) -> Optional[Advice]:
    if figures.precision == "bf16-mixed" or not figures.curve or figures.last_step is None:
        return None
    start = _leading_row(figures)[1] + 1  # backoffs of the initial calibration are `init_scale`'s business
    scaling = set(_scaling_skips(figures)) if figures.skipped is not None else None
    backoffs = [
        (s, a, b)
        for s, a, b in _changes(figures.curve)
        if b < a and s > start and (scaling is None or s - 1 in scaling)  # caused by an overflow a scale can avoid
    ]
    if not backoffs:
        return None
    step, before, after = backoffs[0]
    if any(b > a for s, a, b in _changes(figures.curve) if s > step):
        return None  # it grew back
    after_backoff = [m["underflow_fraction"] for m in _measured(figures) if m["step"] >= step]
    if not after_backoff or sum(after_backoff) / len(after_backoff) < GROWTH_UNDERFLOW:
        return None  # the lower scale costs nothing measured: no reason to grow back sooner
    skipped_after = [s for s in figures.skipped or [] if s >= step]
    clean_after = figures.last_step - step + 1 - len(skipped_after)
    if clean_after < MIN_UPDATES_AFTER_BACKOFF:
        return None
    interval = (figures.knobs or {}).get("growth_interval")
    suggested = _nice(max(1, clean_after // 4))
    if interval is not None and suggested >= interval:
        return None
    what = f" (growth_interval={interval})" if interval is not None else ""
    return Advice(
        "growth_interval",
        f"After the backoff at step {step} ({_scale(before)} -> {_scale(after)}) the scale never grew back in"
        f" {clean_after} clean updates{what}, while {100 * sum(after_backoff) / len(after_backoff):.0f}% of the"
        " non-zero gradient elements sat below float16's smallest normal: the run is shorter than a few growth"
        " intervals.",
        plugin_fix(figures, growth_interval=suggested),
        {
            "backoff_step": step,
            "clean_updates_after": clean_after,
            "growth_interval": interval,
            "underflow_after": sum(after_backoff) / len(after_backoff),
        },
    )


def _spikes(figures: RunFigures, interval: int, cap: float) -> list[int]:
    """Isolated overflows at the cap: alone (no skip on either side), one halving, after ``interval`` clean updates."""
    skipped = set(figures.skipped or [])
    halved = {s for s, a, b in _changes(figures.curve) if b < a}
    scaling = set(_scaling_skips(figures))
    settled = _leading_row(figures)[1]  # the leading skips are the calibration's, not spikes
    return [
        s
        for s in (figures.skipped or [])
        if s >= settled
        and s in scaling
        and s - 1 not in skipped
        and s + 1 not in skipped
        and s + 1 in halved  # one overflow, one halving
        and value_at(figures.curve, s) >= cap
        and _held_clean(figures, s) >= interval
    ]


@rule(
    "hysteresis",
    evidence="3+ isolated overflows at `max_scale`, each after `growth_interval`+ clean updates there, each "
    "halving the scale, with 5%+ of the true gradient lost at the halved scale.",
    fix="`hysteresis=2`.",
    look_alike="The saw-tooth: each growth into the ceiling overflows once (`hysteresis=2` adds skips there).",
    blind="only live: it needs the cap",
    measured=_knobs_known,
)
def _hysteresis(figures: RunFigures) -> Optional[Advice]:
    """Rare spikes at ``max_scale``, each halving a scale the run holds, where the halved scale loses gradient bits.

    An overflow right after the scale grew is the scale finding its ceiling (a saw-tooth): hysteresis there only
    adds skips. A spike is an overflow at ``max_scale`` after at least ``growth_interval`` clean updates there (the
    run holds that scale), and the advice needs the measured cost of halving it: underflow at the halved scale.
    """
    if figures.precision == "bf16-mixed" or not figures.curve or figures.skipped is None:
        return None
    knobs = figures.knobs or {}
    interval, cap = knobs.get("growth_interval"), knobs.get("max_scale")
    if knobs.get("hysteresis", 1) != 1 or interval is None or cap is None:
        return None  # offline the knobs are unknown: a spike cannot be told from the scale's ceiling
    spikes = _spikes(figures, interval, cap)
    if len(spikes) < MIN_ISOLATED_BACKOFFS:
        return None
    regrowth = [_regrowth(figures, s) for s in spikes]
    if any(r is None for r in regrowth[:-1]):
        return None  # no regrowth between them: not rare spikes
    lost = [m["underflow_fraction"] for m in _measured(figures) if m["scale"] < cap]
    if not lost or sum(lost) / len(lost) < GROWTH_UNDERFLOW:
        return None  # the halved scale costs nothing measured: hysteresis would only add skips
    grown = [r for r in regrowth if r is not None]
    return Advice(
        "hysteresis",
        f"{len(spikes)} isolated overflows at max_scale={_scale(cap)} (at step {', '.join(map(str, spikes[:5]))}"
        f"{', ...' if len(spikes) > 5 else ''}), each after {interval}+ clean updates there, halved the scale, which"
        f" took {min(grown)} to {max(grown)} updates to grow back while"
        f" {100 * sum(lost) / len(lost):.0f}% of the non-zero gradient elements were lost to float16 at the lower"
        " scale.",
        plugin_fix(figures, "back off on the 2nd overflow, not on each spike", hysteresis=2),
        {"isolated_overflows": spikes, "regrowth_updates": grown, "underflow_below_cap": sum(lost) / len(lost)},
    )


def _held_clean(figures: RunFigures, step: int) -> int:
    """Clean updates in a row at the scale ``step`` used, before it."""
    since = max(s for s, _ in figures.curve if s <= step)
    skipped = set(figures.skipped or [])
    return sum(1 for s in range(since, step) if s not in skipped)


def _regrowth(figures: RunFigures, step: int) -> Optional[int]:
    """Updates from the halving after ``step`` until the scale was back where it was (None: never)."""
    before = value_at(figures.curve, step)
    back = [s for s, v in figures.curve if s > step + 1 and v >= before]
    return back[0] - (step + 1) if back else None


@rule(
    "skip_rate",
    evidence="More skips than a settling loss scale makes (its leading skips, then about one per growth, and one "
    "more), half the updates or more skipped or a quarter after the leading skips, 3+ skips in a row where the run "
    "ended, a skip born before backward (no loss scale causes it), or the scale held at its floor by skips; counted "
    "over the skips no code above explains (an origin code explains the skips it counts, a scale code all).",
    fix="`NaNSkipReporter(report_path=...)` to see each skip (where it was born, its offenders). Offline, where"
    " the run had one: `AmpAdvisor()`, which reads its origins live; where it had an advisor too, that advisor's"
    " findings. Skips born in an earlier micro-batch where no "
    "module was named: a short run with `Trainer(accumulate_grad_batches=1)` tells where.",
    look_alike="A healthy saw-tooth: leading skips while the scale settles, then one skip per growth attempt.",
    unless_explained=True,
)
def _skip_rate(figures: RunFigures) -> Optional[Advice]:
    """A run that skipped more than a healthy dynamic loss scaler does, which no other code explains.

    Healthy: a few leading skips while the scale settles, then about one skip per growth attempt (each growth probes
    the range once), all born in backward, the scale above its floor. Anything more is never called healthy.
    """
    # the skips no code above explains (all, where none spoke); the scale's settling is read from the rest, in place
    rest = (
        replace(figures, skipped=[s for s in figures.skipped if s not in figures.explained])
        if figures.explained and figures.skipped is not None
        else figures
    )
    skipped = len(rest.skipped or [])
    explained = len(figures.skipped or []) - skipped
    if not figures.num_updates or not skipped:
        return None
    rate = skipped / figures.num_updates
    trailing = trailing_streak(rest)
    leading, growths = _settling(figures)
    expected = leading + growths + 1
    early = [
        o
        for o in _known_origins(figures, unnamed=True)
        if o.phase not in (Phase.BACKWARD, Phase.UNKNOWN) and o.step not in figures.explained
    ]
    # offline: the skips whose loss the reporter logged inf/nan (where, the log does not say)
    early_logged = sorted(figures.loss_nonfinite or []) if figures.origins is None else []
    floor = _held_at_floor(rest)
    if skipped < 2 and not early and not early_logged and not floor:
        return None  # one skip alone: a scale's first meeting with the gradients
    calm = skipped <= expected and not early and not early_logged and not floor
    # the rate after the scale settled: its leading skips are calibration, whatever the run's length
    settled = (skipped - leading) / (figures.num_updates - leading) if figures.num_updates > leading else 0.0
    if rate < HIGH_SKIP_RATE and settled < SETTLED_SKIP_RATE and trailing < TRAILING_STREAK and calm:
        return None
    saw = []
    if skipped > expected and not figures.curve:
        saw.append("bf16 has no loss scale to settle: each skip is a gradient that held inf/nan")
    elif skipped > expected:
        saw.append(
            f"a settling loss scale skips about {expected} here ({leading} leading, {growths} growth"
            f"{'s' if growths != 1 else ''}, one more)"
        )
    if early_logged:
        saw.append(
            f"{len(early_logged)} {'was' if len(early_logged) == 1 else 'were'} born before backward (the loss was"
            " already inf/nan: the batch, a forward or the loss; the log does not say which), which no loss scale"
            " causes"
        )
    if early:
        unread = sum(1 for o in early if o.reason == EARLIER_MICRO_BATCH)
        # an earlier micro-batch's phase is not told (its batch is not kept): only the others' are said
        phases = sorted({o.phase.value for o in early if o.reason != EARLIER_MICRO_BATCH})
        unnamed = sum(1 for o in early if o.unnamed) - unread
        saw.append(
            f"{len(early)} {'was' if len(early) == 1 else 'were'} born before backward"
            + (f" ({', '.join(phases)})" if phases else "")
            + ", which no loss scale causes"
            + (f"; {unnamed} before the watch named a module" if unnamed else "")
            + (
                f"; {unread} in an earlier micro-batch of {'its' if unread == 1 else 'their'} update, where no"
                " module was named (the batch, your code or the loss: an earlier micro-batch's batch is not kept"
                " to tell them apart)"
                if unread
                else ""
            )
        )
    if floor:
        saw.append(f"the scale sat at its floor min_scale={_scale((figures.knobs or {})['min_scale'])}")
    if trailing >= TRAILING_STREAK:
        saw.append(f"the last {trailing} in a row, where the run ended")
    if not saw and rate >= HIGH_SKIP_RATE:
        saw.append("half the updates or more")
    elif not saw:
        saw.append(
            "a quarter or more after the leading skips (a growth interval that short wastes them: each growth skips)"
        )
    return Advice(
        "skip_rate",
        (
            f"{skipped} more of {figures.num_updates} updates were skipped beside the {explained} explained above"
            f" ({100 * rate:.1f}%): "
            if explained
            else f"{skipped} of {figures.num_updates} updates were skipped ({100 * rate:.1f}%): "
        )
        + "; ".join(saw)
        + ". No rule here explains why: "
        + ("no update was applied." if skipped >= figures.num_updates else "the weights moved on the rest only."),
        "Trainer(accumulate_grad_batches=1)  # your other Trainer arguments and plugin kept, a short run: each"
        " micro-batch is an update of its own, so where they were born is told"
        if early and any(o.reason == EARLIER_MICRO_BATCH for o in early)
        else "read the findings this run's AmpAdvisor printed at the end of fit (TensorBoard: the amp/advice text):"
        " it read where each skip was born from the run's NaNSkipReporter; this log does not hold it"
        if figures.reporter_logged and figures.advisor_logged
        else "AmpAdvisor()  # live: it reads where each skip was born from the NaNSkipReporter this run already had"
        if figures.reporter_logged
        else 'NaNSkipReporter(report_path="skips.json")  # each skip with its offenders and where inf/nan was born',
        {
            "skipped": skipped,
            "updates": figures.num_updates,
            "rate": rate,
            "trailing_streak": trailing,
            "expected": expected,
            "born_before_backward": len(early) or len(early_logged),
            "at_floor": floor,
            **({"explained": explained} if explained else {}),
        },
    )


def _settling(figures: RunFigures) -> tuple[int, int]:
    """A run's settling skips and how often its scale grew.

    Settling: the skips a loss scale could have avoided in a row from its first update (:func:`_leading_row`: one
    born before backward is stepped over, uncounted), or those before the scale first grew within the run's first
    tenth (a settle-down that starts at step 1).
    """
    if not figures.curve:
        return 0, 0  # no loss scale (bf16): nothing settles, nothing grows
    first = figures.curve[0][0]
    leading = _leading_row(figures)[0]
    skipped = set(_scaling_skips(figures))
    scales = [v for _, v in figures.curve]
    grew = [step for (step, b), a in zip(figures.curve[1:], scales, strict=False) if b > a]
    # settling: the skips before the scale first grew, in the run's first tenth (the scale meets the gradients early)
    window = first + max(1, figures.num_updates // 10)
    early = sum(1 for s in skipped if s < window and (not grew or s < grew[0]))
    return max(leading, early), len(grew)


def _held_at_floor(figures: RunFigures) -> bool:
    """Whether skips held the scale at its floor: it ends at ``min_scale``, and a skip came there or took it there.

    A skip's backoff that ended at the floor: the scaler wanted lower, and the next overflow is a collapse.
    """
    min_scale = (figures.knobs or {}).get("min_scale")
    if min_scale is None or not figures.curve or not figures.skipped or min_scale <= 0:
        return False
    floor = scale_floor(min_scale)
    if figures.curve[-1][1] > floor:
        return False
    backed_off = len(figures.curve) > 1 and figures.curve[-1][1] < figures.curve[-2][1]
    # the curve's point at a step is the backoff of the skip just before it
    return (backed_off and figures.curve[-1][0] - 1 in set(figures.skipped)) or any(
        value_at(figures.curve, s) <= floor for s in figures.skipped
    )


def trailing_streak(figures: RunFigures) -> int:
    """Skipped updates in a row that end the run (at ``last_step``); 0 when its last update was applied."""
    skipped = set(figures.skipped or [])
    if figures.last_step is None:
        return 0
    count = 0
    while figures.last_step - count in skipped:
        count += 1
    return count


def _nice(n: int) -> int:
    """The largest of 1, 2, 5, 10, 20, 50, ... not above ``n``."""
    best = 1
    for magnitude in range(10):
        for digit in (1, 2, 5):
            value = digit * 10**magnitude
            if value <= n:
                best = value
    return best
