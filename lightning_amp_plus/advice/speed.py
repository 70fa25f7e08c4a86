"""Speed hints: ``silent_fp32`` (a float32 module that runs faster lowered) and ``fused_optimizer``."""

from __future__ import annotations

from typing import Optional

from lightning_amp_plus.advice.registry import Advice, RunFigures, rule

#: how many times faster a float32 module must run lowered (measured) before silent_fp32 names it
MIN_LOWERED_SPEEDUP = 1.2


#: the share of the run's step a fused optimizer must save in three timed pairs of four before fused_optimizer is told
MIN_FUSED_GAIN = 0.02


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
    fix="Your own optimizer call with `fused=True`. A fused step's skip is told once its flag reaches the host"
    " (at once on CPU, by the next batch on a GPU).",
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
        f"{names}. Skips are then told once the flag is read.",
        "\n".join(o.get("fused_call") or f"torch.optim.{o['name']}(params, fused=True)" for o in gains),
        {"optimizers": gains},
    )
