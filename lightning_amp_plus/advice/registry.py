"""The registry: :class:`Advice`, :class:`RunFigures`, :class:`Rule`, :func:`rule`, :func:`advise` and the verdict line.

Each advice code is one declared :class:`Rule` (:data:`RULES`, in order of importance): its check, what it needs
measured, whether it explains skipped updates, and the row the documentation's table gives it (:func:`docs_table`).
:func:`needs_live`, :func:`collapse_advice` and the table are derived from it. The rules themselves live in the
family files beside this one; ``lightning_amp_plus.advice`` imports them in the order of importance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from lightning_amp_plus.advice.fix import _scale


@dataclass
class Advice:
    """One finding: a stable ``code``, a one-sentence ``message`` with the run's figures, a paste-able ``fix``.

    ``evidence`` holds the figures the rule used.
    """

    code: str
    message: str
    fix: str
    evidence: dict[str, Any] = field(default_factory=dict)
    #: the skipped steps it explains where it speaks of some skips only (an origin rule: the skips it counted);
    #: None: every skip (a scale rule). Read by :func:`advise` for ``skip_rate``; not in the JSON.
    explains: Optional[frozenset[int]] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The advice as a JSON-ready dict."""
        found = asdict(self)
        del found["explains"]
        return found

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
        reporter_logged: offline, whether a ``NaNSkipReporter`` logged the skips (``step_skipped``): the run had one,
            and only a live advisor reads its origins; None: live, or not known.
        advisor_logged: offline, whether a live ``AmpAdvisor`` logged its findings (``amp/advice``): it read the
            origins at the end of that fit, and printed them; None: live, or not known.
        loss_nonfinite: offline, the skipped steps whose loss was already inf/nan (the reporter's
            ``skip_loss_nonfinite`` series): born in the batch, a forward or the loss, never the scale's. None: not
            logged (live, the origins tell it).
        auto_islands: live, the islands ``auto_islands=True`` added in this run, in order (each from the step after
            the skip that named it); ``auto_fix``: the plugin's line for the next run with them (one rule: the
            plugin's). Empty and None: not asked, or none added.
        explained: the skipped steps the advice above explained (set by :func:`advise` for ``skip_rate``, which
            judges the rest); empty: none.
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
    reporter_logged: Optional[bool] = None
    advisor_logged: Optional[bool] = None
    loss_nonfinite: Optional[list[int]] = None
    auto_islands: tuple[str, ...] = ()
    auto_fix: Optional[str] = None
    explained: frozenset[int] = frozenset()


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


#: every advice code, most important first: a non-finite batch is no scaling problem; what the model makes in any
#: precision; an fp32 island fixes a module that overflows; bf16 when no scale fits; then the knobs; then many skips
#: nothing above explains; then speed. The one place the order is decided (the family files declare in any order).
CODES = (
    "nonfinite_loss",
    "model_nonfinite",
    "fp32_module",
    "own_code",
    "bf16",
    "backward_skips",
    "nonfinite_batches",
    "zero_gradients",
    "init_scale",
    "max_scale",
    "growth_interval",
    "hysteresis",
    "skip_rate",
    "silent_fp32",
    "fused_optimizer",
)
#: every advice code's rule, in the order of :data:`CODES`
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
    """Declare the check below as advice ``code``'s rule (kept in :data:`RULES` in the order of :data:`CODES`)."""
    if code not in CODES:
        raise ValueError(f"advice code {code!r} is not in CODES: add it there, at its place in order of importance")

    def declare(check: Callable[[RunFigures], Optional[Advice]]) -> Callable[[RunFigures], Optional[Advice]]:
        RULES[code] = Rule(
            code, check, measured, explains_skips, unless_explained, speed, evidence, fix, look_alike, blind
        )
        declared = sorted(RULES.values(), key=lambda r: CODES.index(r.code))
        RULES.clear()
        RULES.update((r.code, r) for r in declared)
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
    rest = unexplained(figures, [a for a in found if RULES[a.code].explains_skips])  # a speed hint explains none
    if rest is not None:
        found += [a for r in RULES.values() if r.unless_explained for a in [r.check(rest)] if a is not None]
    found.sort(key=lambda a: CODES.index(a.code))
    return found


def unexplained(figures: RunFigures, explaining: list[Advice]) -> Optional[RunFigures]:
    """The figures with the skips ``explaining`` explains marked (``explained``); None: it explains them all.

    An advice explains every skip unless it names the steps it speaks of (:attr:`Advice.explains`: an origin rule's
    few skips). ``skip_rate`` judges the rest, with the scale's settling read from every skip.
    """
    if any(a.explains is None for a in explaining):
        return None
    if not explaining or figures.skipped is None:
        return figures
    steps = frozenset().union(*(a.explains or () for a in explaining))
    if all(s in steps for s in figures.skipped):
        return None
    return replace(figures, explained=steps)


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
