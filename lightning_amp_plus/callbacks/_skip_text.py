"""A skip's record and the lines it is told in: one per skipped update, and the summaries (plain data, no state)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_amp_plus._repr import number
from lightning_amp_plus.forensics.origin import EARLIER_MICRO_BATCH, WATCHING, Origin, Phase


def skip_record(step: int, scale: Any, new_scale: Any, told: dict[str, Any], scaled: bool = True) -> dict[str, Any]:
    """One skip's record (the one place its keys are written): ``told`` holds its loss, offenders and origin.

    The origin is kept in its JSON form (:meth:`Origin.to_dict`): a record is plain data. Not ``scaled`` (bf16-mixed:
    no loss scale), ``scale`` and ``new_scale`` are None.
    """
    origin = told.get("origin")
    return {
        "step": step,
        "scale": scale if scaled else None,
        "new_scale": new_scale if scaled else None,
        "loss": told.get("loss"),
        "offenders": told.get("offenders"),
        "origin": origin.to_dict() if isinstance(origin, Origin) else origin,
    }


def enough(printed: int) -> str:
    """Said after the last skip printed one by one."""
    return (
        f"`NaNSkipReporter`: {plural(printed, 'skipped step')} printed; further skips are counted in `.skips` and"
        " summarised at the end of fit."
    )


def plural(n: int, noun: str) -> str:
    """``1 skip``, ``2 skips``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def describe(record: dict[str, Any], hysteresis: int = 1, min_scale: float = 0.0, backoff_on: str = "any") -> str:
    """A skip's line.

    ``hysteresis``, ``min_scale`` (the scaler's) and ``backoff_on`` (the plugin's) say why a scale was held.
    """
    offenders = record["offenders"]
    if offenders is None:
        where = "gradients non-finite (found by a fused optimizer; `NaNSkipReporter(sync_fused=True)` names them)"
    elif not offenders:
        where = "gradients non-finite"
    else:
        parts = []
        for o in offenders[:3]:
            kinds = " and ".join(f"{o[k]} {k}" for k in ("inf", "nan") if o[k])
            parts.append(f"{o['name']} ({kinds})")
        more = f" and {len(offenders) - 3} more" if len(offenders) > 3 else ""
        where = "gradients non-finite in " + ", ".join(parts) + more
    born = describe_origin(record.get("origin"), record.get("loss"))
    if born:
        where = f"{born}; {where}"
    if record["scale"] is None:  # bf16-mixed: no loss scale
        return f"step {record['step']} skipped: {where}"
    scale = f"loss scale {number(record['scale'])}"
    if record["new_scale"] is not None:
        scale += f" -> {number(record['new_scale'])}"
        if record["new_scale"] == record["scale"]:
            phase = (record.get("origin") or {}).get("phase")
            loss_born = backoff_on == "backward" and phase in ("input", "forward", "loss")
            scale += (
                " (kept: the loss already held inf/nan; backoff_on='backward')"
                if loss_born
                else _held(record["scale"], hysteresis, min_scale)
            )
    return f"step {record['step']} skipped: {where}, {scale}"


def _held(scale: float, hysteresis: int, min_scale: float) -> str:
    """Why a skip left the scale where it was."""
    if scale <= min_scale:
        return f" (held at min_scale={number(min_scale)})"
    if hysteresis > 1:
        nth = _ordinal(hysteresis)
        return f" (kept: with hysteresis={hysteresis}, the scale backs off at the {nth} overflow since it last grew)"
    return ""


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def describe_origin(told: Optional[dict[str, Any]], loss: Any = None) -> str:
    """``born in forward of encoder.3.ff (inf)`` and the like (from a record's origin); empty when not known.

    ``loss``: the record's loss, whose ``"-inf"`` a loss read alone tells (an origin's kind says ``inf`` for both).
    """
    try:
        origin = Origin.from_dict(told) if told else None
    except ValueError:  # a phase or verdict this version does not know
        origin = None
    if origin is None:
        return ""
    watching = "; every module is watched from the next step" if origin.reason == WATCHING else ""
    if origin.phase is Phase.FORWARD:
        if origin.module is None and origin.within is None and origin.reason == EARLIER_MICRO_BATCH:
            was = loss if loss in ("inf", "-inf", "nan") else origin.kind or "inf/nan"
            return (
                f"born before backward, in an earlier micro-batch (its loss was {was}: the batch, a forward or the"
                " loss; no module was named there)"
            )
        if origin.module is None and origin.within is None:  # read from the loss: no module watched
            named = "no module named yet: " if origin.reason == WATCHING else ""
            # nothing watched yet tells a module's forward from the loss function: both said
            was = loss if loss in ("inf", "-inf", "nan") else origin.kind or "inf/nan"
            return f"born in forward or in the loss (the loss was {was}; {named}{origin.reason})"
        if origin.module is None:
            return f"born in forward of {origin.within} (the module inside: unknown, {origin.reason})"
        where = f"{origin.where} (between its module calls)" if origin.own_code else origin.where
        fed = f"; it took a float16 -inf from {origin.fed_by}" if origin.fed_by else ""
        also = f"; born on their own in {', '.join(origin.also)} too" if origin.also else ""
        return f"born in forward of {where} ({origin.kind}{fed}{also})"
    if origin.phase is Phase.LOSS and origin.op is not None:  # what the loss's graph shows it took the log of
        return f"born in the loss (every watched module output was finite; it takes the {origin.op} of float16 values)"
    if origin.phase is Phase.BACKWARD and origin.batch_too:
        return "born in backward (the loss was finite; the batch held inf/nan)"
    return {
        Phase.INPUT: f"born in the batch (the inputs held inf/nan{watching})",
        Phase.LOSS: "born in the loss (every watched module output was finite)",
        Phase.BACKWARD: "born in backward (the loss was finite)",
        Phase.UNKNOWN: f"origin unknown ({origin.reason})",
    }[origin.phase]


def collapse_message(
    record: dict[str, Any],
    consecutive: int,
    limit: Optional[int],
    min_scale: Optional[float],
    cause: Any,
    batch: tuple[int, int] = (0, 0),
) -> str:
    """``LossScaleCollapseError``'s message: why it stopped, the scale, the offenders, the advisor's diagnosis.

    ``min_scale`` given: it overflowed there. ``cause``: the advisor's ``Advice`` (its fix is the HINT), or None.
    ``batch``: how many of how many skips so far were born in the batch (they drove the scale down too).
    """
    if min_scale is not None:
        why = (
            f"step {record['step']} overflowed while the loss scale already sat at min_scale={number(min_scale)}"
            f" ({plural(consecutive, 'consecutive skipped step')})"
        )
    else:
        were = "was" if consecutive == 1 else "were"
        why = f"{plural(consecutive, 'consecutive optimizer step')} {were} skipped (max_consecutive_skips={limit})"
    offenders = ", ".join(o["name"] for o in (record["offenders"] or [])[:5]) or "unknown"
    scale = f"; loss scale {number(record['scale'])}" if record["scale"] is not None else ""  # bf16: none
    message = f"Mixed-precision training collapsed: {why}{scale}; last offenders: {offenders}."
    if batch[0] and (cause is None or not cause.evidence.get("input")):  # unless the diagnosis says the batch
        one = batch[0] == 1
        message += (
            f" Of the {plural(batch[1], 'skipped update')} so far, {batch[0]} {'was' if one else 'were'} born in the"
            f" batch (inf/nan in the data): the scale backed off for {'it' if one else 'them'} too, though no loss"
            ' scale fixes data. `AmpPlusPrecision(..., backoff_on="backward")` leaves the scale alone for them.'
        )
    if cause is not None:
        return f"{message} {cause.message} HINT: {cause.fix}"
    return (
        f"{message} HINT: lower the learning rate, check the inputs for inf/nan, keep the named layers in float32"
        " (`AmpPlusPrecision(fp32_modules=[...])`), or use precision='bf16-mixed'."
    )


def summary(report: dict[str, Any]) -> str:
    """The end-of-fit line: how many updates were skipped, at which steps, and the worst offenders."""
    worst = ", ".join(f"{w['name']} ({plural(w['skips'], 'skip')})" for w in report["worst_offenders"][:5])
    steps = report["skipped_steps"]
    shown = ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "")
    return (
        f"`NaNSkipReporter`: {len(steps)} of {report['num_steps']} updates skipped (at step {shown}); worst"
        f" offenders: {worst or 'unknown'}."
    )
