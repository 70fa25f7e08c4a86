"""Float16's range at the scale's floor: when bf16 is the fix (``bf16``), and skips born in backward.

Rules ``bf16`` and ``backward_skips``, and the helpers only they use.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from lightning_amp_plus._limits import MAX_ISLANDS, scale_floor
from lightning_amp_plus._series import value_at
from lightning_amp_plus.advice.figures import (
    HIGH_UNDERFLOW,
    _high_underflow,
    _known_origins,
    _measured,
    _origins_measured,
    _referenced,
    most,
    told_skips,
)
from lightning_amp_plus.advice.fix import _given_islands, _scale, plugin_fix
from lightning_amp_plus.advice.origins import _own_code_origins
from lightning_amp_plus.advice.registry import Advice, RunFigures, rule
from lightning_amp_plus.forensics.origin import Origin, Phase, Verdict


def _forward_overflows(figures: RunFigures) -> list[Origin]:
    """Origins of an fp16 overflow in a module's forward (finite in float32), with the module named."""
    return [o for o in _known_origins(figures) if o.overflow]


@rule(
    "bf16",
    evidence="Float16's range fails, and bf16 autocast runs on the device. One of: the float32 reference finds "
    "no scale that fits; underflow >= 0.5 with under 1 bit of headroom; a forward overflow no island "
    "contains; 2+ backward overflows at `min_scale` (or one the run stopped at) with under a bit of "
    "headroom, or a rerun finite in float32.",
    fix='`AmpPlusPrecision("bf16-mixed", ...)`, the scaler\'s knobs dropped.',
    look_alike="A run where a scale fits. A NaN the backward makes in any precision.",
    blind="partly: the origins are seen live only",
)
def _bf16(figures: RunFigures) -> Optional[Advice]:
    if figures.precision == "bf16-mixed" or figures.bf16_available is False:
        return None
    for reading in (_bf16_squeezed, _bf16_unfit, _bf16_uncontained, _bf16_own_code, _bf16_at_floor):
        found = reading(figures)
        if found is not None:
            message, evidence = found
            fix = plugin_fix(figures, "float32's range: no loss scale needed", precision="bf16-mixed")
            return Advice("bf16", message, fix, evidence)
    return None


def _bf16_squeezed(figures: RunFigures) -> Optional[tuple[str, dict[str, Any]]]:
    measured = _measured(figures)
    squeezed = [m for m in _high_underflow(figures) if m.get("headroom_bits") is not None and m["headroom_bits"] < 1.0]
    if not most(len(squeezed), len(measured)):
        return None
    worst = max(m["underflow_fraction"] for m in squeezed)
    return (
        f"The gradients span more range than float16 has: in {len(squeezed)} of {len(measured)} measurements up"
        f" to {100 * worst:.0f}% of the non-zero gradient elements were below float16's smallest normal while the"
        " largest was less than one doubling from overflow, so no loss scale fits.",
        {"measurements": len(measured), "squeezed": len(squeezed), "worst_underflow": worst},
    )


def _bf16_unfit(figures: RunFigures) -> Optional[tuple[str, dict[str, Any]]]:
    measured = _measured(figures)
    unfit = [(m, fit) for m, fit in _referenced(figures) if fit[1] >= HIGH_UNDERFLOW]
    if not most(len(unfit), len(measured)):  # measured exactly: no scale keeps what float16 loses
        return None
    scale, lost = max(unfit, key=lambda pair: pair[1][1])[1]
    return (
        f"The gradients span more range than float16 has: in {len(unfit)} of {len(measured)} measurements, even"
        f" at {_scale(scale)} (the largest scale that does not overflow) {100 * lost:.0f}% of the elements"
        " whose float32 gradient is non-zero would sit below float16's smallest normal, so no loss scale fits.",
        {"measurements": len(measured), "unfit": len(unfit), "lost_at_fitting_scale": lost},
    )


def _bf16_uncontained(figures: RunFigures) -> Optional[tuple[str, dict[str, Any]]]:
    """Most told skips a forward overflow no island contains: the value is beyond float16 anywhere.

    Measured by a replay (no islands fix it), or watched where the run holds :data:`MAX_ISLANDS` islands already
    and the values are born in another module still.
    """
    origins = _known_origins(figures)
    loose = [o for o in _forward_overflows(figures) if not o.islands]
    full = len(_given_islands(figures)) >= MAX_ISLANDS
    moved = [o for o in origins if o.observed and full and o.name not in _given_islands(figures)]
    if not most(len(loose) + len(moved), len(origins), least=2):
        return None
    module = Counter(o.name for o in loose + moved).most_common(1)[0][0]
    measured = "" if len(moved) > len(loose) else " (finite in float32)"
    why = (
        f"the run keeps {len(_given_islands(figures))} modules in float32 already and they are born in another"
        if len(moved) > len(loose)
        else "no fp32 islands a replay could check contain it (its float32 output does not fit float16 where it flows"
        f" next, or more than {MAX_ISLANDS} modules would have to, or the LightningModule's own code carries it on"
        " where a replay cannot follow)"
    )
    return (
        f"Non-finite values were born in the forward of {module} (and others) in {len(loose) + len(moved)} of"
        f" {told_skips(figures, len(origins))}: float16 overflows there{measured}, and {why}. bfloat16 holds float32's"
        " range.",
        {"uncontained": len(loose) + len(moved), "told": len(origins), "module": module},
    )


def _bf16_own_code(figures: RunFigures) -> Optional[tuple[str, dict[str, Any]]]:
    """Most told skips an fp16 overflow in the LightningModule's own code, which a rerun found finite in float32."""
    origins = _known_origins(figures)
    own = [o for o in _own_code_origins(figures, Verdict.FINITE) if o.bf16 is Verdict.FINITE]
    if not most(len(own), len(origins), least=2):
        return None
    return (
        f"Non-finite values were born in the LightningModule's own code, between its module calls, in {len(own)} of"
        f" {told_skips(figures, len(origins))}, and the step rerun in float32 and under bfloat16 is finite: float16's"
        " range fails there, where no fp32 island reaches (islands are modules). bfloat16 holds float32's range.",
        {"own_code": len(own), "told": len(origins)},
    )


def _backward_at_floor(figures: RunFigures) -> list[int]:
    """Skips with forward and loss finite (or of unknown origin) while the scale sat at its floor."""
    knobs = figures.knobs or {}
    min_scale = knobs.get("min_scale")
    if min_scale is None or figures.skipped is None or not figures.curve:
        return []
    born = {o.step: o.phase for o in _known_origins(figures, unnamed=True) if o.step is not None}
    return [
        s
        for s in figures.skipped
        if value_at(figures.curve, s) <= scale_floor(min_scale)
        and born.get(s, Phase.BACKWARD) in (Phase.BACKWARD, Phase.UNKNOWN)
    ]


def _enough_at_floor(figures: RunFigures, at_floor: list[int]) -> bool:
    """Two overflows at the floor, or one the run stopped at (a collapse stops at the first)."""
    return len(at_floor) >= 2 or (bool(at_floor) and at_floor[-1] == figures.last_step)


def _range_at_floor(figures: RunFigures) -> Optional[str]:
    """Why overflows at the floor are float16's range, when something measured says so (None: nothing does)."""
    backward = [o for o in _known_origins(figures) if o.phase is Phase.BACKWARD and o.float32 is not None]
    if backward:
        finite = [o for o in backward if o.float32 is Verdict.FINITE]
        return "a rerun found the gradients finite in float32" if most(len(finite), len(backward)) else None
    floor = scale_floor((figures.knobs or {}).get("min_scale", 1.0))
    tight = [m for m in _measured(figures) if m["scale"] <= floor and (m.get("headroom_bits") or 99.0) < 1.0]
    if tight:
        return f"clean updates at that scale left {min(m['headroom_bits'] for m in tight):.1f} bits of headroom"
    return None


def _bf16_at_floor(figures: RunFigures) -> Optional[tuple[str, dict[str, Any]]]:
    at_floor = _backward_at_floor(figures)
    why = _range_at_floor(figures)
    if not _enough_at_floor(figures, at_floor) or why is None:
        return None
    min_scale = (figures.knobs or {})["min_scale"]
    return (
        f"{len(at_floor)} update{'s' if len(at_floor) != 1 else ''} overflowed in backward with the loss scale"
        f" already at min_scale="
        f"{_scale(min_scale)}, and {why}: the gradients exceed float16's range even unscaled.",
        {"overflows_at_min_scale": len(at_floor), "first": at_floor[0], "min_scale": min_scale, "why": why},
    )


@rule(
    "backward_skips",
    evidence="2+ updates skipped at `min_scale` (or one the run stopped at) with forward and loss finite. "
    "Nothing measured tells float16's range (bf16 fixes it) from a backward that makes inf/nan in any "
    "precision (a model fix does).",
    fix="`NaNSkipReporter(backward_origin=True)`: it reruns your step on such skips, names the op, and "
    "says if float32 makes it too. Then `model_nonfinite` or `bf16`.",
    look_alike="Overflows at `min_scale` with a measured range cause (`bf16`).",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
)
def _backward_skips(figures: RunFigures) -> Optional[Advice]:
    if figures.precision == "bf16-mixed" or figures.origins is None:
        return None  # a log holds no origins: forward and loss finite is not known offline
    at_floor = _backward_at_floor(figures)
    if not _enough_at_floor(figures, at_floor) or _range_at_floor(figures) is not None:
        return None
    if any(o.phase is Phase.BACKWARD and o.float32 is not None for o in _known_origins(figures)):
        return None  # told by a rerun: model_nonfinite or bf16 says it
    min_scale = (figures.knobs or {})["min_scale"]
    return Advice(
        "backward_skips",
        f"{len(at_floor)} update{'s were' if len(at_floor) != 1 else ' was'} skipped with forward and loss finite"
        " while the loss scale sat at"
        f" min_scale={_scale(min_scale)}: either the gradients exceed float16's range even unscaled (bf16 fixes"
        " that) or the backward makes inf/nan in any precision (a sqrt, log or division at 0; no precision fixes"
        " that). Nothing this run measured tells which, without running the step again.",
        "NaNSkipReporter(backward_origin=True)  # runs your step again on skips: the op and its float32 verdict",
        {"skipped_at_min_scale": len(at_floor), "first": at_floor[0], "min_scale": min_scale},
    )
