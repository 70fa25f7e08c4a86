"""The lines a skip is told in: one per skipped update, and the counts in summaries (plain text, no state)."""

from __future__ import annotations

from typing import Any, Optional


def plural(n: int, noun: str) -> str:
    """``1 skip``, ``2 skips``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def describe(record: dict[str, Any]) -> str:
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
    born = describe_origin(record.get("origin"))
    if born:
        where = f"{born}; {where}"
    scale = f"loss scale {record['scale']:g}"
    if record["new_scale"] is not None:
        scale += f" -> {record['new_scale']:g}"
    return f"step {record['step']} skipped: {where}, {scale}"


def describe_origin(origin: Optional[dict[str, Any]]) -> str:
    """``born in forward of encoder.3.ff (inf)`` and the like; empty when the origin is not known."""
    if not origin:
        return ""
    phase = origin.get("phase")
    if phase == "forward":
        if origin.get("module") is None:
            return f"born in forward of {origin.get('within')} (the module inside: unknown, {origin.get('reason')})"
        where = origin.get("module") or "the LightningModule's own code (between its recorded module calls)"
        return f"born in forward of {where} ({origin.get('kind')})"
    if phase == "input":
        return "born in the batch (the inputs held inf/nan)"
    if phase == "loss":
        return "born in the loss (every recorded module output was finite)"
    if phase == "backward":
        return "born in backward (forward and loss finite)"
    if phase == "unknown":
        return f"origin unknown ({origin.get('reason')})"
    return ""
