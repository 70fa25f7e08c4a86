"""The loss scale's level: ``zero_gradients``, ``init_scale`` (and the scale too low), ``max_scale``."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_amp_plus import knobs
from lightning_amp_plus._series import value_at
from lightning_amp_plus.advice.figures import (
    HIGH_UNDERFLOW,
    _high_underflow,
    _leading_row,
    _measured,
    _referenced,
    _scaling_skips,
    fitting_scale,
    most,
)
from lightning_amp_plus.advice.fix import _scale, plugin_fix
from lightning_amp_plus.advice.registry import Advice, RunFigures, rule

#: the highest scale a fix proposes (float32 holds up to 2**127; beyond 2**64 no gradient is that small)
MAX_PROPOSED_SCALE = 2.0**64


def _cap(figures: RunFigures) -> float:
    """The run's ``max_scale`` (inf: none); torch's default where the run's knobs are not known."""
    cap = (figures.knobs or {}).get("max_scale", knobs.DEFAULTS["max_scale"])
    return math.inf if cap is None else float(cap)


def _overflowed(figures: RunFigures) -> float:
    """The lowest scale this run's backward overflowed at (inf: none), a bound no scale fix goes to.

    The run's own overflows measured what the weights' headroom cannot see: the activations' gradients.
    """
    return min((value_at(figures.curve, s) for s in _scaling_skips(figures)), default=math.inf)


def _at_max(figures: RunFigures, measurement: dict[str, Any]) -> bool:
    return figures.knobs is not None and measurement["scale"] >= _cap(figures)


@rule(
    "zero_gradients",
    evidence="No float32 reference. Most measurements found every gradient element float16 held exactly zero, "
    "with a finite non-zero loss. Flushed or truly zero: only float32 tells.",
    fix="`GradUnderflowMonitor(exact=True)`: the float32 reference tells which and measures the scale "
    "that keeps them. Then `max_scale` or `bf16`.",
    look_alike="A loss of exactly 0.",
    blind="only live: the loss is measured live",
    measured=lambda f: f.underflow is not None and all("loss" in m for m in f.underflow),
    explains_skips=False,
)
def _zero_gradients(figures: RunFigures) -> Optional[Advice]:
    """Every gradient float16 held exactly zero, at most measurements, while the loss was finite and not zero.

    Without a float32 reference a zero cannot be told flushed from structural, so the figures say only that nothing
    trained, and how to tell (the reference then gives ``max_scale`` or ``bf16`` advice with its measured scale).
    """
    measured = [m for m in figures.underflow or [] if m.get("reference") is None and m.get("zero_fraction") is not None]
    dead = [m for m in measured if m["zero_fraction"] == 1.0 and m.get("loss") not in (None, 0.0)]
    if not most(len(dead), len(measured)):
        return None
    return Advice(
        "zero_gradients",
        f"In {len(dead)} of {len(measured)} measurements every gradient element float16 held was exactly zero while"
        f" the loss was finite and not zero (e.g. {dead[-1]['loss']:.3g} at step {dead[-1]['step']}, loss scale"
        f" {_scale(dead[-1]['scale'])}): the optimizer consumed zeros. Either float16 flushed gradients too small for"
        " this scale, or they are zero in float32 too (the loss does not depend on the weights); measuring once"
        " against float32 tells which, and the scale that keeps them.",
        "GradUnderflowMonitor(exact=True)  # a float32 reference: it runs your step again every N steps",
        {"measurements": len(measured), "all_zero": len(dead), "loss": dead[-1]["loss"], "scale": dead[-1]["scale"]},
    )


@rule(
    "init_scale",
    evidence="The first 2+ updates were skipped while the scale came down from `init_scale`, and a later one "
    "applied. Or, without a float32 reference: underflow >= 0.5 in most measurements, 2+ bits of "
    "headroom, the scale below its cap.",
    fix="`init_scale=` the scale it settled at. For a scale too low: the scale the headroom allows, a "
    "doubling below overflow (`max_scale` too where needed).",
    look_alike="One calibration skip. High underflow with under 2 bits of headroom.",
)
def _init_scale(figures: RunFigures) -> Optional[Advice]:
    if figures.precision == "bf16-mixed" or not figures.curve:
        return None
    too_low = _scale_too_low(figures)  # measured, and never above where the run overflowed: told first
    leading, after = _leading_row(figures)
    if too_low is not None or leading < 2 or leading >= figures.num_updates:
        return too_low  # one skip is calibration; all skipped: the scale never settled (others say)
    init = figures.curve[0][1]
    settled = _settled(figures.curve, after, set(_scaling_skips(figures)))
    if settled >= init:
        return None
    down = value_at(figures.curve, after)  # where the leading skips left it
    later = f", and settled at {_scale(settled)} before it first grew" if settled < down else ""
    unknown = (
        " The log does not say where they were born: a batch, a forward or a loss that held inf/nan looks the same"
        " (a `NaNSkipReporter` logs it, and the scale then counts only skips it could avoid)."
        if figures.origins is None and figures.loss_nonfinite is None
        else ""
    )
    row = after - figures.curve[0][0]  # the leading skips, with any no loss scale causes among them
    first = f"The first {leading}" if row == leading else f"{leading} of the first {row}"
    return Advice(
        "init_scale",
        f"{first} updates were skipped while the loss scale came down from {_scale(init)} to"
        f" {_scale(down)}{later}: those batches trained nothing.{unknown}",
        plugin_fix(figures, init_scale=settled),
        {"leading_skips": leading, "init_scale": init, "settled_scale": settled},
    )


def _settled(curve: list[tuple[int, float]], step: int, scaling: set[int]) -> float:
    """The scale from ``step`` on, until it first grows: its lowest (a later calibration skip lowers it further).

    Only a backoff from a skip a scale could have avoided (in ``scaling``) counts: one from a NaN batch does not.
    """
    lowest = value_at(curve, step)
    for at, value in curve:
        if at > step:
            if value > lowest:
                break
            if at - 1 in scaling:  # the curve's point at `at` is the skip at `at - 1`'s backoff
                lowest = value
    return lowest


def _scale_too_low(figures: RunFigures) -> Optional[Advice]:
    """Most measurements: most non-zero gradient elements subnormal in float16, 2+ bits of headroom, below the cap.

    Without a float32 reference (which measures the scale that fits: ``max_scale``). A higher scale moves the
    subnormal elements into float16's normal range while the largest stays a doubling below overflow.
    """
    measured = _measured(figures)
    low = [
        m
        for m in _high_underflow(figures)
        if fitting_scale(m) is None
        and m.get("headroom_bits") is not None
        and m["headroom_bits"] >= 2.0
        and not _at_max(figures, m)
    ]
    if not most(len(low), len(measured)):
        return None
    new = min(min(m["scale"] * 2.0 ** math.floor(m["headroom_bits"] - 1) for m in low), MAX_PROPOSED_SCALE)
    overflowed = _overflowed(figures)
    new = min(new, overflowed / 2)
    if new < 4 * max(m["scale"] for m in low):
        return None  # under 2 bits to gain below the scale the run overflowed at: no higher scale to give
    last = low[-1]
    # the cap raised with it where it is below, or not known (a resumed run's may be its checkpoint's): pinned there,
    # a higher init_scale alone would be brought down to it
    capped = figures.knobs is None or new > _cap(figures)
    change: dict[str, Any] = {"init_scale": new, **({"max_scale": new} if capped else {})}
    below = (
        f", a doubling below {_scale(overflowed)}, where this run's backward overflowed"
        if math.isfinite(overflowed)
        else "; where the activations' gradients, which only a float32 reference measures, overflow sooner, the"
        " scaler backs off from there"
    )
    return Advice(
        "init_scale",
        f"In {len(low)} of {len(measured)} measurements {100 * max(m['underflow_fraction'] for m in low):.0f}% of"
        f" the non-zero gradient elements sat below float16's smallest normal while the weights' largest gradient"
        f" left {last['headroom_bits']:.1f} bits of headroom (at loss scale {_scale(last['scale'])}, step"
        f" {last['step']}): the scale is too low for these gradients. {_scale(new)} keeps the largest a doubling"
        f" below overflow at every measurement{below}.",
        plugin_fix(figures, **change),
        {"measurements": len(measured), "low": len(low), "scale": last["scale"], "proposed_scale": new},
    )


@rule(
    "max_scale",
    evidence="Underflow >= 0.5 in most measurements, and the float32 reference shows a higher scale that fits. "
    "Without a reference: the scale pinned at `max_scale` with 2+ bits of headroom.",
    fix="`max_scale=` and `init_scale=` that scale: a doubling below overflow, below any scale the run overflowed at.",
    look_alike="An embedding run whose zeros are structural.",
    blind="partly: the float32 reference is live only",
    measured=lambda f: f.underflow is not None and f.knobs is not None,  # needs the measurements and the cap
)
def _max_scale(figures: RunFigures) -> Optional[Advice]:
    measured = _measured(figures)
    fits = [(m, fit) for m, fit in _referenced(figures) if fit[1] < HIGH_UNDERFLOW and fit[0] > m["scale"]]
    if most(len(fits), len(measured)):  # measured exactly: a higher scale keeps what float16 loses
        new = min(min(fit[0] for _, fit in fits), MAX_PROPOSED_SCALE)
        worst = max(m["underflow_fraction"] for m, _ in fits)
        cap = (figures.knobs or {}).get("max_scale")
        change: dict[str, Any] = (
            {"max_scale": new, "init_scale": new} if cap is None or new > cap else {"init_scale": new}
        )
        return Advice(
            "max_scale",
            f"In {len(fits)} of {len(measured)} measurements up to {100 * worst:.0f}% of the gradient elements whose"
            f" float32 gradient is non-zero were zero or subnormal in float16 at loss scale"
            f" {_scale(fits[-1][0]['scale'])}; their float32 reference shows that {_scale(new)} fits (the largest"
            " gradient at the weights and at each module's output, a doubling below overflow) and keeps them. A"
            " gradient in your own code between module calls is not measured: if one overflows there, the scaler"
            " backs off below it.",
            plugin_fix(figures, **change),
            {"measurements": len(measured), "lost": len(fits), "worst_underflow": worst, "fitting_scale": new},
        )
    return _max_scale_pinned(figures, measured)


def _max_scale_pinned(figures: RunFigures, measured: list[dict[str, Any]]) -> Optional[Advice]:
    """Without a reference: the scale pinned at the cap while the weights' gradients leave headroom."""
    pinned = [
        m
        for m in _high_underflow(figures)
        if _at_max(figures, m) and m.get("headroom_bits") is not None and m["headroom_bits"] >= 2.0
    ]
    if not most(len(pinned), len(measured)):
        return None
    assert figures.knobs is not None
    max_scale = figures.knobs["max_scale"]
    room = min(m["headroom_bits"] for m in pinned)
    new = min(max_scale * 2.0 ** math.floor(room - 1), max(MAX_PROPOSED_SCALE, max_scale), _overflowed(figures) / 2)
    if new <= max_scale:
        return None  # the run's backward overflowed just above the cap: no higher scale to give
    return Advice(
        "max_scale",
        f"The scale sits at max_scale={_scale(max_scale)} while"
        f" {100 * max(m['underflow_fraction'] for m in pinned):.0f}% of the non-zero gradient elements sit below"
        f" float16's smallest normal and the weights' largest gradient leaves {room:.1f} bits of headroom: the cap"
        f" holds the scale down. Started and capped at {_scale(new)}, the largest stays a doubling below overflow;"
        " where the activations' gradients, which only a float32 reference measures, overflow sooner, the scaler"
        " backs off from there.",
        plugin_fix(figures, init_scale=new, max_scale=new),
        {"max_scale": max_scale, "headroom_bits": room, "measurements": len(measured), "pinned": len(pinned)},
    )
