"""What went wrong in a mixed-precision run, and the one-line fix: the rules behind ``AmpAdvisor`` and ``advise``.

Standard library only (the ``advise`` command reads logs without torch). :func:`advise` reads a :class:`RunFigures`
(built live by :class:`~lightning_amp_plus.AmpAdvisor` from the plugin and the callbacks, or offline from a logged
run by :func:`figures_from_series`) and returns :class:`Advice` objects, most important first.

Each advice code is one declared :class:`Rule` (:data:`RULES`, in order of importance): its check, what it needs
measured, whether it explains skipped updates, and the row the documentation's table gives it (:func:`docs_table`).
:data:`CODES`, :func:`needs_live`, :func:`collapse_advice` and the table are derived from it. A figure that is
missing (``None``) makes its rule stay silent.
"""

from __future__ import annotations

import ast
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_amp_plus import knobs
from lightning_amp_plus._limits import MAX_ISLANDS, scale_floor
from lightning_amp_plus._series import logged_updates, prefix_of, scale_changes, scale_key, skipped_steps, value_at
from lightning_amp_plus.forensics.origin import IN_ISLAND, Origin, Phase, Verdict

#: an underflow fraction from which the gradients count as losing much to fp16 (GradUnderflowMonitor's default)
HIGH_UNDERFLOW = 0.5
#: clean updates after a backoff with no growth before the growth interval is worth advice
MIN_UPDATES_AFTER_BACKOFF = 50
#: isolated overflows (each halving the scale, with regrowth in between) before hysteresis is worth advice
MIN_ISOLATED_BACKOFFS = 3
#: mean underflow fraction after a backoff from which the lower scale costs gradient bits (growth_interval)
GROWTH_UNDERFLOW = 0.05
#: skip rate from which a run that no other code explains is reported (skip_rate)
HIGH_SKIP_RATE = 0.5
#: skipped updates in a row at the end of a run from which it is reported (skip_rate): it ended training on nothing
TRAILING_STREAK = 3
#: how many times faster a float32 module must run lowered (measured) before silent_fp32 names it
MIN_LOWERED_SPEEDUP = 1.2
#: the share of the run's step a fused optimizer must save in three timed pairs of four before fused_optimizer is told
MIN_FUSED_GAIN = 0.02
#: the highest scale a fix proposes (float32 holds up to 2**127; beyond 2**64 no gradient is that small)
MAX_PROPOSED_SCALE = 2.0**64


@dataclass
class Advice:
    """One finding: a stable ``code``, a one-sentence ``message`` with the run's figures, a paste-able ``fix``.

    ``evidence`` holds the figures the rule used.
    """

    code: str
    message: str
    fix: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The advice as a JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}\n    fix: {self.fix}"


@dataclass
class RunFigures:
    """What a run measured; ``None`` means not measured (its rules stay silent).

    Attributes:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (None: unknown, e.g. offline).
        num_updates: updates recorded (skipped ones included).
        last_step: the last recorded update's step.
        curve: the scale's change points ``[(step, scale)]`` (16-mixed).
        skipped: the steps of the skipped updates (None: not known, e.g. a stock plugin's sampled curve).
        knobs: the scaler's settings (``init_scale``, ``growth_interval``, ``hysteresis``, ``min_scale``,
            ``max_scale``, ``growth_factor``, ``backoff_factor``); None offline.
        underflow: ``GradUnderflowMonitor`` measurements (``step``, ``scale``, ``underflow_fraction``,
            ``headroom_bits``, and ``loss``, ``reference``, ``fitting_scale`` ... when measured live).
        origins: per skipped update whose origin was told, ``NaNSkipReporter``'s ``origin`` dict (with its ``step``).
        fp32_rows: ``PrecisionReport`` rows flagged as heavy float32 work (``name``, ``type``, ``time_share``,
            ``cause``, ``island``).
        non_fused: optimizers with a fused implementation on their device that run non-fused (``name``,
            ``device``, ``fused_call``, and the measured ``step_ms`` / ``fused_step_ms`` of one optimizer step
            (medians of ``pairs`` alternating timings), ``gain_ms`` / ``gain_low_ms`` (the median and lower quartile
            of the pairs' differences) and the run's ``train_step_ms``).
        bf16_available: whether bf16 autocast is available on the run's device.
        plugin: the run's plugin class name (fix lines are the user's own call with one change).
        plugin_args: the arguments the plugin was given (those that differ from its defaults), in order.
        ended: how the fit ended where an exception ended it (``"AssertionError: bad batch"``); None: it ran to its
            end (or unknown, offline).
    """

    precision: Optional[str] = None
    num_updates: int = 0
    last_step: Optional[int] = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    skipped: Optional[list[int]] = None
    knobs: Optional[dict[str, Any]] = None
    underflow: Optional[list[dict[str, Any]]] = None
    origins: Optional[list[dict[str, Any]]] = None
    fp32_rows: Optional[list[dict[str, Any]]] = None
    non_fused: Optional[list[dict[str, Any]]] = None
    bf16_available: Optional[bool] = None
    plugin: str = "AmpPlusPrecision"
    plugin_args: dict[str, Any] = field(default_factory=dict)
    ended: Optional[str] = None


# ---------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Rule:
    """One advice code, declared once: its check and everything derived from it.

    Attributes:
        code: the stable string.
        check: the figures -> the advice, or None (silent).
        measured: whether the figures hold what the check reads (else :func:`needs_live` names the code).
        explains_skips: the advice says why updates were skipped (``skip_rate`` stays silent beside it).
        unless_explained: told only when no advice that explains skips was (``skip_rate``).
        speed: a speed hint, not a health finding (said after the verdict, one short line).
        evidence, fix, look_alike, blind: the documentation's entry (what it reads, what it proposes, the
            healthy run it stays silent on, what ``advise`` cannot see of it).
    """

    code: str
    check: Callable[[RunFigures], Optional[Advice]]
    measured: Callable[[RunFigures], bool]
    explains_skips: bool
    unless_explained: bool
    speed: bool
    evidence: str
    fix: str
    look_alike: str
    blind: str


#: every advice code's rule, most important first: a non-finite batch is no scaling problem; what the model makes
#: in any precision; an fp32 island fixes a module that overflows; bf16 when no scale fits; then the knobs; then
#: many skips nothing above explains; then speed
RULES: dict[str, Rule] = {}


def _always(figures: RunFigures) -> bool:
    return True


def rule(
    code: str,
    *,
    evidence: str,
    fix: str,
    look_alike: str,
    blind: str = "",
    measured: Callable[[RunFigures], bool] = _always,
    explains_skips: bool = True,
    unless_explained: bool = False,
    speed: bool = False,
) -> Callable[[Callable[[RunFigures], Optional[Advice]]], Callable[[RunFigures], Optional[Advice]]]:
    """Declare the check below as advice ``code``'s rule (in the order of importance the declarations give)."""

    def declare(check: Callable[[RunFigures], Optional[Advice]]) -> Callable[[RunFigures], Optional[Advice]]:
        RULES[code] = Rule(
            code, check, measured, explains_skips, unless_explained, speed, evidence, fix, look_alike, blind
        )
        return check

    return declare


def findings(found: list[Advice]) -> tuple[list[Advice], list[Advice]]:
    """``found`` split into health findings and speed hints (:attr:`Rule.speed`)."""
    return [a for a in found if not RULES[a.code].speed], [a for a in found if RULES[a.code].speed]


def hint_line(hint: Advice) -> str:
    """A speed hint as one short line: what was measured, then the fix."""
    return f"speed hint [{hint.code}]: {hint.message} Fix: {'; '.join(hint.fix.splitlines())}"


def advise(figures: RunFigures) -> list[Advice]:
    """The advice the figures support, most important first (the order of :data:`CODES`): findings, then hints."""
    found = [a for r in RULES.values() if not r.unless_explained for a in [r.check(figures)] if a is not None]
    if not any(RULES[a.code].explains_skips for a in found):  # a speed hint explains no skip
        found += [a for r in RULES.values() if r.unless_explained for a in [r.check(figures)] if a is not None]
    found.sort(key=lambda a: CODES.index(a.code))
    return found


def needs_live(figures: RunFigures) -> list[str]:
    """The codes these figures cannot support (what they read was not measured)."""
    return [code for code, r in RULES.items() if not r.measured(figures)]


def collapse_advice(figures: RunFigures) -> Optional[Advice]:
    """The first advice that explains skips, said when a run collapses (``LossScaleCollapseError``'s HINT).

    The advisor's reading, said the same way; never ``skip_rate`` (it explains nothing).
    """
    return next((a for a in advise(figures) if RULES[a.code].explains_skips and a.code != "skip_rate"), None)


def docs_table() -> str:
    """The documentation's list of the advice codes (docs/guide/advisor.md holds it verbatim; a test checks)."""
    lines: list[str] = []
    for r in RULES.values():
        lines += [f"### `{r.code}`", ""]
        if r.speed:
            lines += ["A speed hint: said on one line after the verdict, never a health finding.", ""]
        lines += [f"- **Evidence**: {r.evidence}", f"- **Fix**: {r.fix}", f"- **Silent on**: {r.look_alike}"]
        lines += [f"- **Offline** (`advise`): {r.blind or 'read from the logged series'}.", ""]
    return "\n".join(lines).rstrip("\n")


def nothing_applied(figures: RunFigures) -> bool:
    """Whether every update of the run was skipped (then it is never called healthy, advice or not)."""
    return bool(figures.num_updates) and len(figures.skipped or []) >= figures.num_updates


def judged(figures: RunFigures) -> bool:
    """Whether the figures can call a run healthy: it ran to its end, its skips are known, and some were applied.

    A stock plugin logs no skips; a fit an exception ended is never healthy.
    """
    return (
        figures.ended is None
        and figures.skipped is not None
        and bool(figures.num_updates)
        and not nothing_applied(figures)
    )


def healthy_line(figures: RunFigures) -> str:
    """One line with the run's figures, for a run that got no advice (never "healthy" when nothing was applied).

    A figure the logs cannot support is absent, never a healthy-looking 0: unknown skips are said to be unknown.
    """
    if figures.ended is not None:  # a fit an exception ended is never healthy
        count = f", {len(figures.skipped)} skipped" if figures.skipped is not None else ""
        return (
            f"no finding, but the fit did not end as planned: {figures.ended} after {figures.num_updates}"
            f" update{'' if figures.num_updates == 1 else 's'}{count}."
        )
    if not figures.num_updates and figures.skipped is not None:
        return "no update was made, so nothing could be judged."
    if figures.skipped is None:
        reach = f", the loss scale logged to step {figures.last_step}" if figures.curve else ""
        return (
            f"its skipped updates were not logged (Lightning's own plugin logs none), so whether updates were skipped,"
            f" and why, could not be judged{reach}."
        )
    skipped = len(figures.skipped)
    if nothing_applied(figures):
        return (
            f"no finding, and no update applied: {skipped} of {figures.num_updates} skipped, too few to tell why (a"
            " first skip is the scale's calibration); a longer run tells."
        )
    rate = skipped / figures.num_updates if figures.num_updates else 0.0
    parts = [
        f"{figures.num_updates} update{'' if figures.num_updates == 1 else 's'}",
        f"skip rate {100 * rate:.1f}% ({skipped} skipped)",
    ]
    headroom = [m["headroom_bits"] for m in (figures.underflow or []) if m.get("headroom_bits") is not None]
    if headroom:
        parts.append(f"headroom {headroom[-1]:.1f} bits")
    if figures.curve and figures.precision != "bf16-mixed":
        parts.append(f"loss scale {_scale(figures.curve[-1][1])}")
    return "the run looks healthy: " + ", ".join(parts) + "."


# ---------------------------------------------------------------------------------------------- reading the figures


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


def _scaling_skips(figures: RunFigures) -> list[int]:
    """The skipped steps a loss scale could have avoided.

    All but those born in the batch, the loss or a forward, and those whose float32 replay is non-finite too (a
    backward that makes inf/nan at any scale).
    """
    not_scaling = {
        o.step
        for o in _known_origins(figures, unnamed=True)
        if o.step is not None
        and (o.phase in (Phase.INPUT, Phase.LOSS, Phase.FORWARD) or o.float32 is Verdict.NONFINITE)
    }
    return [s for s in figures.skipped or [] if s not in not_scaling]


def _origins_measured(figures: RunFigures) -> bool:
    return figures.origins is not None


def _underflow_measured(figures: RunFigures) -> bool:
    return figures.underflow is not None


def _high_underflow(figures: RunFigures) -> list[dict[str, Any]]:
    return [m for m in _measured(figures) if m["underflow_fraction"] >= HIGH_UNDERFLOW]


def _measured(figures: RunFigures) -> list[dict[str, Any]]:
    """The measurements with an underflow figure (an overflowed or all-zero update has none)."""
    return [m for m in figures.underflow or [] if m.get("underflow_fraction") is not None]


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


def _forward_overflows(figures: RunFigures) -> list[Origin]:
    """Origins of an fp16 overflow in a module's forward (finite in float32), with the module named."""
    return [o for o in _known_origins(figures) if o.overflow]


def _model_made(figures: RunFigures) -> list[Origin]:
    """Origins whose values the model makes in float32 too (forward or, told by a rerun, backward)."""
    return [o for o in _known_origins(figures) if o.float32 is Verdict.NONFINITE]


# ---------------------------------------------------------------------------------------------- the rules
@rule(
    "nonfinite_loss",
    evidence="Half or more of the skips with a known origin: the batch held inf/nan, or the loss was inf/nan "
    "while every watched module output was finite.",
    fix="A guard on the batch (its targets too), or the loss in float32. Never an island.",
    look_alike="A module's fp16 overflow. NaN-coded values the step fills in before the model.",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
)
def _nonfinite_loss(figures: RunFigures) -> Optional[Advice]:
    origins = _known_origins(figures)
    phases = Counter(o.phase for o in origins)
    bad = phases[Phase.INPUT] + phases[Phase.LOSS]
    if not most(bad, len(origins), half=True):
        return None
    guard = (
        "assert all(torch.isfinite(t).all() for t in batch if torch.is_tensor(t) and t.is_floating_point()),"
        ' "inf/nan in the batch"  # first line of training_step; then fix the data pipeline'
    )
    at_loss = [o for o in origins if o.phase is Phase.LOSS]
    if phases[Phase.INPUT] >= phases[Phase.LOSS]:
        what = f"the batch's inf/nan reached the model in {phases[Phase.INPUT]} of {len(origins)} skipped updates"
        fix = guard
    elif most(sum(o.batch_too for o in at_loss), len(at_loss)):  # the targets: no float32 loss makes NaN finite
        what = (
            f"the loss was inf/nan with every watched module output finite in {phases[Phase.LOSS]} of {len(origins)}"
            " skipped updates, and the batch held inf/nan there (the targets or weights the loss reads, say)"
        )
        fix = guard
    else:
        what = (
            f"the loss was inf/nan with every watched module output finite in {phases[Phase.LOSS]} of {len(origins)}"
            " skipped updates"
        )
        fix = "loss = loss_fn(logits.float(), target)  # compute the loss in float32; check log/div/sqrt for 0 and <0"
    return Advice(
        "nonfinite_loss",
        f"{what[0].upper()}{what[1:]}: not a scaling problem (no loss scale or fp32 island fixes it).",
        fix,
        {"input": phases[Phase.INPUT], "loss": phases[Phase.LOSS], "told": len(origins)},
    )


#: the guard each backward op that makes inf/nan at a point needs (``SqrtBackward0`` -> ``sqrt``)
_GUARDS = {
    "Sqrt": "torch.sqrt(x.clamp_min(1e-12))  # sqrt's gradient at 0 is inf",
    "Pow": "x.clamp_min(1e-12) ** p  # a fractional power's gradient at 0 is inf",
    "Log": "torch.log(x.clamp_min(1e-12))  # log's gradient at 0 is inf",
    "Div": "a / (b + 1e-12)  # a division's gradient by 0 is inf",
    "Rsqrt": "torch.rsqrt(x.clamp_min(1e-12))",
    "Norm": "torch.linalg.vector_norm(x + 1e-12)  # a norm's gradient at 0 is nan",
    "LinalgVectorNorm": "torch.linalg.vector_norm(x + 1e-12)  # a norm's gradient at 0 is nan",
    "Acos": "torch.acos(x.clamp(-1 + 1e-6, 1 - 1e-6))",
    "Asin": "torch.asin(x.clamp(-1 + 1e-6, 1 - 1e-6))",
    "Atan2": "torch.atan2(y, x + 1e-12)",
}


def _guard(op: Optional[str]) -> Optional[str]:
    """The guard for a backward op's name (``SqrtBackward0``), if it is one that makes inf/nan at a point."""
    base = (op or "").split("Backward")[0]
    return _GUARDS.get(base)


@rule(
    "model_nonfinite",
    evidence="Most told skips were born in one place that makes inf/nan in float32 too: a module's forward, or "
    "a backward op (`backward_origin=True`).",
    fix="Fix the module's inputs (one unmasked key per attention row) or guard the op "
    "(`sqrt(x.clamp_min(eps))`). No island, scale or bf16 helps.",
    look_alike="An fp16 overflow (finite in float32).",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
)
def _model_nonfinite(figures: RunFigures) -> Optional[Advice]:
    """Most skips born in one place that makes inf/nan in float32 too: no precision avoids them."""
    origins = _known_origins(figures)
    places = Counter((o.phase, o.module, o.op) for o in _model_made(figures))
    if not places:
        return None
    top, count = places.most_common(1)[0]
    if not most(count, len(origins)):
        return None
    made = [o for o in _model_made(figures) if (o.phase, o.module, o.op) == top]
    phase, module, op, where = made[0].phase, made[0].name, made[0].op, made[0].where
    if phase is Phase.BACKWARD:
        what = f"in the backward of {where}" + (f" ({op})" if op else "")
        fix = _guard(op) or f"# guard the op in {where} whose gradient is inf/nan at a point (sqrt, log, a division)"
        kind = "a sqrt, log or division at 0 in backward"
    else:
        what = f"in the forward of {where}" + (" (between its module calls)" if made[0].own_code else "")
        fix = (
            f"# fix the inputs of {where} (e.g. give every attention row one unmasked key), or replace its inf/nan:"
            " out = torch.nan_to_num(out)"
        )
        kind = "an all-masked attention row, a log or division of 0"
    watched = any(o.reason == IN_ISLAND for o in made)
    upstream = (
        " (Watched as an fp32 island, from inputs computed in float16: if those differ by less than float16"
        ' resolves, the module before it in float32 fixes it; `NaNSkipReporter(find_origin="replay")` measures'
        " that.)"
        if watched
        else ""
    )
    return Advice(
        "model_nonfinite",
        f"Non-finite values were born {what} in {count} of {len(origins)} skipped updates, and run in"
        f" float32 it makes them too: the model makes them in any precision ({kind}), so no loss scale, fp32"
        f" island or bf16 fixes it.{upstream}{_batch_too(made)}",
        fix,
        {"phase": phase.value, "module": module, "op": op, "skips": count, "told": len(origins)},
    )


@rule(
    "fp32_module",
    evidence="One module's forward made the inf/nan in over half the told skips (2 at least), or several "
    'modules did together. The watch names the module; a replay (`find_origin="replay"`) also '
    "measures its islands finite in float32.",
    fix='`fp32_modules=[..., "that.module"]`, your own islands kept. Born there again in float32: '
    "`model_nonfinite`. Born in the next module: it joins.",
    look_alike="A NaN the model makes in float32 too. An overflow no island contains (`bf16`).",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
)
def _fp32_module(figures: RunFigures) -> Optional[Advice]:
    """Most told skips born in modules' forwards that an island may fix: the union of the islands.

    One module's when it makes most; else every module's that each made them on some batches (three towers). A
    watched origin's island is its module (what float32 there does, the next run tells); a replayed one's, what the
    replay measured.
    """
    origins = _known_origins(figures)
    fixable = [o for o in origins if o.observed or (o.overflow and o.islands)]
    if not most(len(fixable), len(origins), least=2):
        return None
    modules = Counter(o.name for o in fixable)
    module, count = modules.most_common(1)[0]
    if most(count, len(origins), least=2):  # one module makes most: its islands (a rare other one is left alone)
        modules = Counter({module: count})
        fixable = [o for o in fixable if o.name == module]
    given = list(_given_islands(figures))
    islands = list(given)
    for name, _ in modules.most_common():  # the most frequent module's islands first
        for o in fixable:
            if o.name == name:
                islands += [i for i in o.islands or _watched_islands(o) if i not in islands]
    watched = any(o.observed for o in fixable)
    if watched and len(islands) > MAX_ISLANDS:
        return None  # a chain of islands that long: bf16 (below)
    born = set(modules)
    kinds = Counter(o.kind for o in fixable)
    fed = sorted({o.fed_by for o in fixable if o.fed_by in islands and o.fed_by not in born and o.fed_by not in given})
    moved = [i for i in islands if i not in born and i not in given and i not in fed]
    also = f"; in float32 it overflows float16 again in {', '.join(moved)}, which join it" if moved else ""
    took = (
        f" It took a float16 -inf from {', '.join(fed)} (a mask there, or an overflow to -inf), which runs in float32"
        " too."
        if fed
        else ""
    )
    if len(modules) == 1:
        where, whose = f"the forward of {module} in {count}", "its output"
    else:
        where = "the forwards of " + ", ".join(f"{m} ({n})" for m, n in modules.most_common()) + f", {len(fixable)}"
        whose = "each one's output"
    if watched:
        said = (
            f" (watched: nothing measured whether float32 avoids them). Run {'it' if len(modules) == 1 else 'them'}"
            " in float32: a float16 overflow ends there; if they are born there again, float32 makes them too, and"
            ' the advisor says so. `NaNSkipReporter(find_origin="replay")` measures it in the run, by running'
            f" the module again.{took}"
        )
    else:
        said = f": {whose} overflows float16{also}.{took} A replay with these islands computed finite values."
    return Advice(
        "fp32_module",
        f"Non-finite values were born in {where} of {len(origins)} skipped updates"
        f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}){said}",
        plugin_fix(figures, fp32_modules=islands),
        {
            "module": module,
            "skips": len(fixable),
            "told": len(origins),
            "kinds": dict(kinds),
            "islands": islands,
            "measured": not watched,
            **({"modules": dict(modules)} if len(modules) > 1 else {}),
        },
    )


def _watched_islands(origin: Origin) -> tuple[str, ...]:
    """A watched origin's fix: its module and, where it took a float16 ``-inf`` in, the module that made it."""
    return (origin.name, origin.fed_by) if origin.fed_by else (origin.name,)


def _batch_too(origins: list[Origin]) -> str:
    """What to add when the batch held inf/nan of the kind the step's own code passed on (it may have spread them)."""
    if not any(o.batch_too for o in origins):
        return ""
    return (
        " The batch held inf/nan of that kind too: where that code mixes samples (batch statistics, mixup), they"
        " may be the batch's."
    )


def _own_code_origins(figures: RunFigures, float32: Optional[Verdict]) -> list[Origin]:
    """Forward origins in the LightningModule's own code with that float32 verdict (None: none measured)."""
    return [o for o in _known_origins(figures) if o.phase is Phase.FORWARD and o.own_code and o.float32 is float32]


@rule(
    "own_code",
    evidence="Most told skips (2+) were born in the LightningModule's own code between module calls. Nothing "
    "measured tells a float16 overflow (bf16 fixes it) from inf/nan in any precision (a code fix "
    "does). Or a rerun found them finite in float32, not in bfloat16: float16's precision, not its "
    "range.",
    fix="`NaNSkipReporter(backward_origin=True)`: it reruns your step to tell which. For precision: "
    "`fp32_modules=` the modules whose outputs that code takes in.",
    look_alike="A module's fp16 overflow (`fp32_module`).",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
)
def _own_code(figures: RunFigures) -> Optional[Advice]:
    origins = _known_origins(figures)
    unread = _own_code_origins(figures, None)
    precision = [o for o in _own_code_origins(figures, Verdict.FINITE) if o.bf16 is not Verdict.FINITE]
    where = "Non-finite values were born in the LightningModule's own code, between its module calls, in"
    if most(len(precision), len(origins), least=2):
        measured = Counter(o.islands for o in precision if o.islands)
        islands = list(measured.most_common(1)[0][0]) if measured else []
        said = (
            f" A rerun with {', '.join(islands)} in float32 (the modules whose outputs it takes in) is finite."
            if islands
            else " No rerun with the modules it takes in as fp32 islands was finite: that code needs float32 inputs."
        )
        return Advice(
            "own_code",
            f"{where} {len(precision)} of {len(origins)} skipped updates, and the step rerun in float32 is finite"
            " while under bfloat16 it is not (or that could not be run): float16 loses the precision there (a"
            " difference of close values, a division by it), not its range, so neither bf16 nor a loss scale"
            f" fixes it.{said}",
            plugin_fix(figures, fp32_modules=[*_given_islands(figures), *islands])
            if islands
            else "# compute that code, and the module outputs it takes in, in float32 (`fp32_modules=[...]`)",
            {"own_code": len(precision), "told": len(origins), "islands": islands or None},
        )
    if not most(len(unread), len(origins), least=2):
        return None
    kinds = Counter(o.kind for o in unread)
    return Advice(
        "own_code",
        f"{where} {len(unread)} of {len(origins)} skipped updates"
        f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}). No replay reads that code, so nothing this"
        " run measured tells a float16 overflow there (bf16 fixes that) from inf/nan the code makes in any"
        f" precision (a log, sqrt or division of 0: only a code fix does).{_batch_too(unread)}",
        "NaNSkipReporter(backward_origin=True)  # runs your step again on skips, in float32: which of the two",
        {"own_code": len(unread), "told": len(origins), "kinds": dict(kinds)},
    )


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
        f" {len(origins)} skipped updates: float16 overflows there{measured}, and {why}. bfloat16 holds float32's"
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
        f" {len(origins)} skipped updates, and the step rerun in float32 and under bfloat16 is finite: float16's"
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


def _leading_skips(figures: RunFigures) -> int:
    """Skipped updates in a row from the run's first recorded update, each one a loss scale could have avoided."""
    if not figures.skipped or not figures.curve:
        return 0
    first = figures.curve[0][0]
    scaling = set(_scaling_skips(figures))
    count = 0
    for expected, step in enumerate(figures.skipped, start=first):
        if step not in scaling or step != expected:
            break
        count += 1
    return count


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
    leading = _leading_skips(figures)
    if too_low is not None or leading < 2 or leading >= figures.num_updates:
        return too_low  # one skip is calibration; all skipped: the scale never settled (others say)
    init = figures.curve[0][1]
    assert figures.skipped is not None
    after = figures.skipped[leading - 1] + 1
    settled = _settled(figures.curve, after, set(_scaling_skips(figures)))
    if settled >= init:
        return None
    down = value_at(figures.curve, after)  # where the leading skips left it
    later = f", and settled at {_scale(settled)} before it first grew" if settled < down else ""
    return Advice(
        "init_scale",
        f"The first {leading} updates were skipped while the loss scale came down from {_scale(init)} to"
        f" {_scale(down)}{later}: those batches trained nothing.",
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
    leading = _leading_skips(figures)
    start = figures.curve[0][0] + leading + 1  # backoffs of the initial calibration are `init_scale`'s business
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
    return [
        s
        for s in (figures.skipped or [])[_leading_skips(figures) :]
        if s in scaling
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
    "more), half the updates or more skipped, 3+ skips in a row where the run ended, a skip born before backward "
    "(no loss scale causes it), or the scale held at its floor by skips; and no code above explains it.",
    fix="`NaNSkipReporter(report_path=...)` to see each skip (where it was born, its offenders).",
    look_alike="A healthy saw-tooth: leading skips while the scale settles, then one skip per growth attempt.",
    unless_explained=True,
)
def _skip_rate(figures: RunFigures) -> Optional[Advice]:
    """A run that skipped more than a healthy dynamic loss scaler does, which no other code explains.

    Healthy: a few leading skips while the scale settles, then about one skip per growth attempt (each growth probes
    the range once), all born in backward, the scale above its floor. Anything more is never called healthy.
    """
    skipped = len(figures.skipped or [])
    if not figures.num_updates or not skipped:
        return None
    rate = skipped / figures.num_updates
    trailing = trailing_streak(figures)
    leading, growths = _settling(figures)
    expected = leading + growths + 1
    early = [o for o in _known_origins(figures, unnamed=True) if o.phase not in (Phase.BACKWARD, Phase.UNKNOWN)]
    floor = _held_at_floor(figures)
    if skipped < 2 and not early and not floor:
        return None  # one skip alone: a scale's first meeting with the gradients
    if rate < HIGH_SKIP_RATE and trailing < TRAILING_STREAK and skipped <= expected and not early and not floor:
        return None
    saw = []
    if skipped > expected:
        saw.append(
            f"a settling loss scale skips about {expected} here ({leading} leading, {growths} growth"
            f"{'s' if growths != 1 else ''}, one more)"
        )
    if early:
        phases = sorted({o.phase.value for o in early})
        unnamed = sum(1 for o in early if o.unnamed)
        saw.append(
            f"{len(early)} {'was' if len(early) == 1 else 'were'} born before backward ({', '.join(phases)}), which"
            f" no loss scale causes" + (f"; {unnamed} before the watch named a module" if unnamed else "")
        )
    if floor:
        saw.append(f"the scale sat at its floor min_scale={_scale((figures.knobs or {})['min_scale'])}")
    if trailing >= TRAILING_STREAK:
        saw.append(f"the last {trailing} in a row, where the run ended")
    if not saw:
        saw.append("half the updates or more")
    return Advice(
        "skip_rate",
        f"{skipped} of {figures.num_updates} updates were skipped ({100 * rate:.1f}%): " + "; ".join(saw) + ". No"
        " rule here explains why: the weights moved on the rest only.",
        'NaNSkipReporter(report_path="skips.json")  # each skip with its offenders and where inf/nan was born',
        {
            "skipped": skipped,
            "updates": figures.num_updates,
            "rate": rate,
            "trailing_streak": trailing,
            "expected": expected,
            "born_before_backward": len(early),
            "at_floor": floor,
        },
    )


def _settling(figures: RunFigures) -> tuple[int, int]:
    """A run's settling skips and how often its scale grew.

    Settling: the skips in a row from its first update, or those before the scale first grew within the run's first
    tenth (a settle-down that starts at step 1).
    """
    skipped = set(figures.skipped or [])
    if not figures.curve:
        return 0, 0  # no loss scale (bf16): nothing settles, nothing grows
    first = figures.curve[0][0]
    leading = 0
    while first + leading in skipped:
        leading += 1
    scales = [v for _, v in figures.curve]
    grew = [step for (step, b), a in zip(figures.curve[1:], scales, strict=False) if b > a]
    # settling: the skips before the scale first grew, in the run's first tenth (the scale meets the gradients early)
    window = first + max(1, figures.num_updates // 10)
    early = sum(1 for s in skipped if s < window and (not grew or s < grew[0]))
    return max(leading, early), len(grew)


def _held_at_floor(figures: RunFigures) -> bool:
    """Whether skips held the scale at its floor: its last value is ``min_scale`` and a skip came there."""
    min_scale = (figures.knobs or {}).get("min_scale")
    if min_scale is None or not figures.curve or not figures.skipped or min_scale <= 0:
        return False
    floor = scale_floor(min_scale)
    return figures.curve[-1][1] <= floor and any(value_at(figures.curve, s) <= floor for s in figures.skipped)


def trailing_streak(figures: RunFigures) -> int:
    """Skipped updates in a row that end the run (at ``last_step``); 0 when its last update was applied."""
    skipped = set(figures.skipped or [])
    if figures.last_step is None:
        return 0
    count = 0
    while figures.last_step - count in skipped:
        count += 1
    return count


@rule(
    "silent_fp32",
    evidence="A matmul/conv module ran in float32 outside an island, and its recorded inputs run 1.2x+ faster "
    "lowered on this device (median of 5 runs).",
    fix="Remove the cast, or the `autocast(enabled=False)`, the hint names.",
    look_alike="Float16 on a CPU (slower there). A LayerNorm or GELU.",
    blind="only live: `advise` cannot see it",
    measured=lambda f: f.fp32_rows is not None,
    explains_skips=False,
    speed=True,
)
def _silent_fp32(figures: RunFigures) -> Optional[Advice]:
    # work autocast lowers, measured faster lowered on this device; an island is the user's choice
    rows = [
        r
        for r in figures.fp32_rows or []
        if r.get("island") is None and (r.get("lowered_speedup") or 0.0) >= MIN_LOWERED_SPEEDUP
    ]
    if not rows:
        return None
    rows.sort(key=lambda r: r.get("time_share", 0.0), reverse=True)
    top = rows[0]
    cause = top.get("cause") or "an explicit cast"
    if "autocast disabled" in cause:
        fix = f"# run {top['name']} under autocast: remove the `with torch.autocast(..., enabled=False)` around it"
    else:
        fix = f"# drop the `.float()` (or the float32 op) before {top['name']}: let autocast choose its dtype"
    names = ", ".join(
        f"{r['name']} ({100 * r.get('time_share', 0.0):.0f}% of the forward, {r['lowered_speedup']:.1f}x faster"
        " lowered here)"
        for r in rows[:5]
    )
    return Advice(
        "silent_fp32",
        f"{len(rows)} heavy module{'s' if len(rows) != 1 else ''} ran in float32 under"
        f" {figures.precision or 'mixed precision'}: {names}; {top['name']}: {cause}.",
        fix,
        {"modules": [{k: r.get(k) for k in ("name", "type", "time_share", "cause", "lowered_speedup")} for r in rows]},
    )


@rule(
    "fused_optimizer",
    evidence="A torch `SGD`/`Adam`/`AdamW` (`Adagrad` on CPU) runs non-fused, and its fused step, timed here "
    "on copies, saves 2%+ of the step in three of four pairs.",
    fix="Your own optimizer call with `fused=True`. A fused step's skip is then told at the next logging step.",
    look_alike="An optimizer whose fused step saves nothing beyond noise (SGD on a CPU).",
    blind="only live: `advise` cannot see it",
    measured=lambda f: f.non_fused is not None,
    explains_skips=False,
    speed=True,
)
def _fused_optimizer(figures: RunFigures) -> Optional[Advice]:
    gains = []
    for o in figures.non_fused or []:
        low, train = o.get("gain_low_ms"), o.get("train_step_ms")
        timed = o.get("step_ms") is not None and o.get("fused_step_ms") is not None
        # the lower quartile of the paired gains: a gain beyond the timing's noise, never one delta
        if timed and low is not None and train and low / train >= MIN_FUSED_GAIN:
            gains.append(o)
    if not gains:
        return None
    names = "; ".join(
        f"{o['name']}{' over ' + o['params'] if o.get('params') else ''}: fused, its step takes"
        f" {o['fused_step_ms']:.2f} ms, not {o['step_ms']:.2f} ms (timed here), at least"
        f" {100 * o['gain_low_ms'] / o['train_step_ms']:.0f}% of the {o['train_step_ms']:.1f} ms step"
        for o in gains
    )
    return Advice(
        "fused_optimizer",
        f"{names}. Skips are then told at the next logging step.",
        "\n".join(o.get("fused_call") or f"torch.optim.{o['name']}(params, fused=True)" for o in gains),
        {"optimizers": gains},
    )


#: the codes, most important first (the order the rules are declared in)
CODES = tuple(RULES)


# ---------------------------------------------------------------------------------------------- helpers
def plugin_fix(figures: RunFigures, comment: Optional[str] = None, **change: Any) -> str:
    """The run's own plugin call with ``change`` applied: every other argument the user gave stays as given.

    Example:
        >>> figures = RunFigures(plugin_args={"precision": "16-mixed", "growth_interval": 50})
        >>> plugin_fix(figures, hysteresis=2)
        'AmpPlusPrecision("16-mixed", growth_interval=50, hysteresis=2)'
        >>> plugin_fix(figures, "no scale needed", precision="bf16-mixed")
        'AmpPlusPrecision("bf16-mixed")  # no scale needed'
    """
    args = {**figures.plugin_args, **change}
    precision = args.pop("precision", "16-mixed")
    if precision == "bf16-mixed":
        args = {k: v for k, v in args.items() if k not in knobs.NAMES}  # bf16-mixed refuses them
    parts = [f'"{precision}"', *(f"{k}={_literal(v)}" for k, v in args.items())]
    line = f"{figures.plugin}({', '.join(parts)})"
    return f"{line}  # {comment}" if comment else line


def _given_islands(figures: RunFigures) -> list[str]:
    """The islands the user gave the plugin: a fix keeps them."""
    return list(figures.plugin_args.get("fp32_modules") or [])


def _literal(value: Any) -> str:
    """A paste-able literal: powers of two as ``2.0**k``, strings in double quotes, lists of those."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return f'float("{value}")'  # inf: no bound (a literal `inf` is no Python)
        exponent = math.log2(value) if value > 0 else 0.5
        return _scale(value) if exponent == int(exponent) else repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _scale(value: float) -> str:
    """``2.0**16`` for powers of two (paste-able, exact), else the number."""
    if not math.isfinite(value):
        return f'float("{value}")'
    if value > 0:
        exponent = math.log2(value)
        if exponent == int(exponent):
            return f"2.0**{int(exponent)}"
    return f"{value:g}"


def _nice(n: int) -> int:
    """The largest of 1, 2, 5, 10, 20, 50, ... not above ``n``."""
    best = 1
    for magnitude in range(10):
        for digit in (1, 2, 5):
            value = digit * 10**magnitude
            if value <= n:
                best = value
    return best


# ---------------------------------------------------------------------------------------------- offline
#: the hyperparameter (after the monitor's prefix) under which ``LossScaleMonitor`` logs the plugin's call
PLUGIN_HPARAM = "plugin"
#: the plugin classes whose logged call a fix line repeats, and their positional arguments
_PLUGINS = ("AmpPlusPrecision", "AmpPlusFSDPPrecision", "AmpPlusFabricPrecision")
_POSITIONAL = ("precision", "device")


def figures_from_series(
    series: dict[str, list[tuple[int, float]]], hparams: Optional[dict[str, Any]] = None
) -> RunFigures:
    """The figures a logged run supports (the ``advise`` command): scale curve, skips, underflow, headroom.

    ``hparams`` are the run's logged hyperparameters: the plugin's call ``LossScaleMonitor`` logged there (as
    ``amp/plugin``) makes every fix the run's own call with one change, as the live advisor's.
    """
    key = scale_key(series)
    skip_key = next((k for k in series if k.endswith("skipped_steps") or k.endswith("step_skipped")), None)
    prefix = ""
    figures = RunFigures()
    if key is not None:
        prefix = prefix_of(key)
        figures.precision = "16-mixed"
        figures.curve = scale_changes(series, key)
    elif skip_key is not None:
        prefix = skip_key[: skip_key.rindex("/") + 1] if "/" in skip_key else ""
        figures.precision = "bf16-mixed"
    call = parse_plugin_call((hparams or {}).get(prefix + PLUGIN_HPARAM))
    if call is not None:
        figures.plugin, figures.plugin_args = call
        if (
            figures.precision == "16-mixed"
            and "scaler" not in figures.plugin_args
            and bool(figures.curve)
            and figures.curve[0][0] == 0
        ):  # a fit from step 0: a resumed one's knobs may be its checkpoint's, which replace the call's
            given = knobs.knob_values({k: v for k, v in figures.plugin_args.items() if k in knobs.NAMES})
            # the run's own call: its knobs, the defaults where it left them out; the scale where the log starts
            figures.knobs = {**knobs.DEFAULTS, **given, "init_scale": figures.curve[0][1]}
    figures.skipped = skipped_steps(series, prefix)
    underflow = dict(series.get(prefix + "underflow_fraction", []))
    headroom = dict(series.get(prefix + "headroom_bits", []))
    if underflow and figures.curve:
        figures.underflow = [
            {
                "step": step,
                "scale": value_at(figures.curve, step),
                "underflow_fraction": value,
                "headroom_bits": headroom.get(step),
            }
            for step, value in sorted(underflow.items())
        ]
    steps = {s for values in series.values() for s, _ in values}
    if steps:
        figures.last_step = max(steps)
        figures.num_updates = logged_updates(series, prefix, figures.skipped, min(steps), figures.last_step)
    return figures


def plugin_call(plugin: str, args: dict[str, Any]) -> str:
    """The call that built a plugin, as ``LossScaleMonitor`` logs it: :func:`plugin_fix` with no change.

    Example:
        >>> plugin_call("AmpPlusPrecision", {"init_scale": 2.0**20, "fp32_modules": ["head"]})
        'AmpPlusPrecision("16-mixed", init_scale=2.0**20, fp32_modules=["head"])'
    """
    return plugin_fix(RunFigures(plugin=plugin, plugin_args=dict(args)))


def parse_plugin_call(text: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """The plugin class name and arguments of a logged :func:`plugin_call`; None for anything else.

    Only literals are read (numbers, ``2.0**k``, strings, lists, ``None``): nothing is evaluated.

    Example:
        >>> parse_plugin_call('AmpPlusPrecision("16-mixed", init_scale=2.0**20, growth_interval=100)')
        ('AmpPlusPrecision', {'precision': '16-mixed', 'init_scale': 1048576.0, 'growth_interval': 100})
        >>> parse_plugin_call("os.system('x')") is None
        True
    """
    if not isinstance(text, str):
        return None
    try:
        call = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _PLUGINS):
            return None
        if len(call.args) > len(_POSITIONAL) or any(k.arg is None for k in call.keywords):
            return None
        args = {name: _literal_value(node) for name, node in zip(_POSITIONAL, call.args, strict=False)}
        args.update({str(k.arg): _literal_value(k.value) for k in call.keywords})
    except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    return call.func.id, args


def _literal_value(node: ast.AST) -> Any:
    """What :func:`_literal` wrote, read back: constants, ``-x``, ``2.0**k``, lists and tuples of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_literal_value(e) for e in node.elts]
        return values if isinstance(node, ast.List) else tuple(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(_literal_value(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in ("inf", "-inf", "nan")
    ):
        return float(node.args[0].value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _number(_literal_value(node.left)), _number(_literal_value(node.right))
        if abs(exponent) > 1100:
            raise ValueError("exponent out of range")
        return base**exponent
    raise ValueError(f"not a literal: {ast.dump(node)}")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return value
