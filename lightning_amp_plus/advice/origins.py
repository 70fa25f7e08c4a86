"""Where the inf/nan came from: the loss, the model's own NaN, a float16 overflow (an island fixes it), own code.

Rules ``nonfinite_loss``, ``model_nonfinite``, ``fp32_module`` and ``own_code``, and the helpers only they use.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from lightning_amp_plus._limits import MAX_ISLANDS
from lightning_amp_plus.advice.figures import _known_origins, _origins_measured, most, told_skips
from lightning_amp_plus.advice.fix import _given_islands, plugin_fix
from lightning_amp_plus.advice.registry import Advice, RunFigures, rule
from lightning_amp_plus.forensics.origin import IN_ISLAND, WATCHING, Origin, Phase, Verdict


def _model_made(figures: RunFigures) -> list[Origin]:
    """Origins whose values the model makes in float32 too (forward or, told by a rerun, backward)."""
    return [o for o in _known_origins(figures) if o.float32 is Verdict.NONFINITE]


@rule(
    "nonfinite_loss",
    evidence="Half or more of the skips with a known origin: the batch held inf/nan, or the loss was inf/nan "
    "while every watched module output was finite.",
    fix="A guard on the batch (its targets too), or the loss in float32. Where the loss takes the log of a float16 "
    "sigmoid or softmax (read from its graph), the loss from the logits (`binary_cross_entropy_with_logits`, "
    "`cross_entropy`). Never an island.",
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
    guard = _GUARD
    at_loss = [o for o in origins if o.phase is Phase.LOSS]
    if phases[Phase.INPUT] >= phases[Phase.LOSS]:
        what = f"the batch's inf/nan reached the model in {phases[Phase.INPUT]} of {told_skips(figures, len(origins))}"
        fix = guard
    elif most(sum(o.batch_too for o in at_loss), len(at_loss)):  # the targets: no float32 loss makes NaN finite
        what = (
            f"the loss was inf/nan with every watched module output finite in {phases[Phase.LOSS]} of"
            f" {told_skips(figures, len(origins))}, and the batch held inf/nan there (the targets or weights the loss"
            " reads, say)"
        )
        fix = guard
    else:
        what = (
            f"the loss was inf/nan with every watched module output finite in {phases[Phase.LOSS]} of"
            f" {told_skips(figures, len(origins))} (born after the last module call: in your code after it, or in the"
            " loss function)"
        )
        fix = (
            "loss = loss_fn(logits.float(), target)  # logits: the last module's output, in float32 before your code"
            " or the loss touch it; check log/div/sqrt for 0 and <0"
        )
        ops = Counter(o.op for o in at_loss if o.op in _LOSS_FROM_LOGITS)
        if ops and most(ops.most_common(1)[0][1], len(at_loss), half=True):  # the op its graph shows, and its cure
            op = ops.most_common(1)[0][0]
            what = (
                f"the loss was inf/nan with every watched module output finite in {phases[Phase.LOSS]} of"
                f" {told_skips(figures, len(origins))}: its code takes the {op} of float16 values"
                f" ({_LOSS_FROM_LOGITS[op][0]})"
            )
            fix = _LOSS_FROM_LOGITS[op][1]
    return Advice(
        "nonfinite_loss",
        f"{what[0].upper()}{what[1:]}: not a scaling problem (no loss scale or fp32 island fixes it).",
        fix,
        {"input": phases[Phase.INPUT], "loss": phases[Phase.LOSS], "told": len(origins)},
        _explains(figures, [o for o in origins if o.phase in (Phase.INPUT, Phase.LOSS)]),
    )


def _explains(figures: RunFigures, origins: list[Origin]) -> Optional[frozenset[int]]:
    """The skipped steps an origin rule speaks of (:attr:`Advice.explains`); None: every skip.

    None where one's step is not known. The skips read before the watch started come with them (the watch starts at
    the first, from the loss alone, and the next tell where).
    """
    steps = [o.step for o in origins]
    if origins:
        steps += [o.step for o in _known_origins(figures, unnamed=True) if o.reason == WATCHING]
    return None if None in steps else frozenset(s for s in steps if s is not None)


def _loss_tells_the_batch(origins: list[Origin]) -> bool:
    """Whether ``nonfinite_loss`` speaks of the batch: the batch and the loss make half the skips, the batch most."""
    phases = Counter(o.phase for o in origins)
    bad = phases[Phase.INPUT] + phases[Phase.LOSS]
    return most(bad, len(origins), half=True) and phases[Phase.INPUT] >= phases[Phase.LOSS]


#: the batch guard a batch-born skip's fix is
_GUARD = (
    "assert all(torch.isfinite(t).all() for t in batch if torch.is_tensor(t) and t.is_floating_point()),"
    ' "inf/nan in the batch"  # first line of training_step; then fix the data pipeline'
)


@rule(
    "nonfinite_batches",
    evidence="Skips born in the batch (it held inf/nan, and they reached the model or the loss) that "
    "`nonfinite_loss` does not tell (it tells the batch where batch and loss make half the skips, the batch most): "
    "a problem of its own, told beside what explains the other skips.",
    fix="A guard on the batch as the first line of `training_step`; then fix those records in the data pipeline.",
    look_alike="A batch whose inf/nan the step replaces before any module or the loss reads them.",
    blind="only live: `advise` cannot see it",
    measured=_origins_measured,
    explains_skips=False,
)
def _nonfinite_batches(figures: RunFigures) -> Optional[Advice]:
    """Batch-born skips too few for ``nonfinite_loss``: every distinct problem gets its line (a NaN record)."""
    origins = _known_origins(figures)
    # watched: the batch's inf/nan seen reaching a module or the loss (unwatched, a batch may hold masked labels)
    batch = [o for o in origins if o.phase is Phase.INPUT and o.reason is None]
    if not batch or _loss_tells_the_batch(origins):
        return None
    steps = [o.step for o in batch if o.step is not None]
    at = f" (step {', '.join(map(str, steps[:5]))}{', ...' if len(steps) > 5 else ''})" if steps else ""
    return Advice(
        "nonfinite_batches",
        f"{len(batch)} of {told_skips(figures, len(origins))} {'was' if len(batch) == 1 else 'were'} born in the batch"
        f"{at}: the data held inf/nan there, a problem apart from what explains the other skips.",
        _GUARD,
        {"batch": len(batch), "told": len(origins), "steps": steps},
    )


#: a loss's log of a saturating op (``verdict.log_of``): why it is inf, and the loss that takes the logits instead
_LOSS_FROM_LOGITS = {
    "log(sigmoid)": (
        "a sigmoid saturates at 1 or 0 in float16, and log(0) is -inf",
        "loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target.float())"
        "  # from the logits: no sigmoid to saturate",
    ),
    "log(softmax)": (
        "a softmax rounds to 0 in float16, and log(0) is -inf",
        "loss = torch.nn.functional.cross_entropy(logits.float(), target)  # log_softmax inside: no 0 to take",
    ),
}


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
        base = op.split("Backward")[0].lower() if op else None
        what += f" (a {base}: its input is out of its domain)" if base else ""
        # the op the graph shows in it: guard its input (a nan_to_num of the output leaves its backward inf/nan)
        fix = _guard(op) or (
            f"# fix the inputs of {where} (e.g. give every attention row one unmasked key); a sqrt, log or division"
            " there: guard its input (x.clamp_min(1e-12)), not its output"
        )
        kind = (
            f"a {base} of values out of its domain" if base else "an all-masked attention row, a log or division of 0"
        )
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
        f"Non-finite values were born {what} in {count} of {told_skips(figures, len(origins))}, and run in"
        f" float32 it makes them too: the model makes them in any precision ({kind}), so no loss scale, fp32"
        f" island or bf16 fixes it.{upstream}{_batch_too(made)}",
        fix,
        {"phase": phase.value, "module": module, "op": op, "skips": count, "told": len(origins)},
        _explains(figures, made),
    )


@rule(
    "fp32_module",
    evidence="One module's forward made the inf/nan in over half the told skips (2 at least), or several "
    "modules did together (in the same step too: `also`). The watch names the module; a replay "
    '(`find_origin="replay"`) also measures its islands finite in float32. Fewer: told as a problem apart from '
    "what explains the others.",
    fix='`fp32_modules=[..., "that.module"]`, your own islands kept. Born there again in float32: '
    "`model_nonfinite`. Born in the next module: it joins. Up to 4 new modules a run; with 4 islands given and "
    "values born in another module still: `bf16`. Added by `auto_islands=True` in the run: what followed them "
    "(measured), and the plugin's own line for the next run.",
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
    primary = [o for o in origins if o.observed or (o.overflow and o.islands)]
    # modules born on their own beside a skip another rule tells (a NaN float32 makes too): theirs is an island
    beside = [o for o in origins if o.also and o.phase is Phase.FORWARD and o not in primary]
    fixable = primary + beside
    apart = 2 * len(fixable) <= len(origins)  # half or fewer: a problem of its own beside the others, told too
    if not fixable:
        return None
    # a skip counts for each module born in it: the one named and those born on their own beside it (`also`)
    modules = Counter(name for o in fixable for name in dict.fromkeys((o.name, *o.also) if o in primary else o.also))
    module, count = modules.most_common(1)[0]
    majors = Counter({m: n for m, n in modules.items() if most(n, len(origins), least=2)})
    if majors:  # modules that each make most: theirs (a rare other one is left alone)
        modules = majors
        fixable = [o for o in fixable if majors.keys() & ({o.name, *o.also} if o in primary else set(o.also))]
    given = list(_given_islands(figures))
    islands = list(given)
    for name, _ in modules.most_common():  # the most frequent module's islands first
        named = [o for o in fixable if o.name == name]
        for o in named:
            islands += [i for i in o.islands or _watched_islands(o) if i not in islands]
        if not named and name not in islands:  # only ever born beside another (`also`): its own island
            islands.append(name)
    watched = any(o.observed for o in fixable) or bool(beside)  # `also` is always watched, never measured
    if watched and (len(given) >= MAX_ISLANDS or len(islands) - len(given) > MAX_ISLANDS):
        return None  # a chain of islands that long, or that many modules at once: bf16 (below)
    born = set(modules)
    # the kinds the named modules made (a module born beside another: its kind is not kept)
    kinds = Counter(o.kind for o in fixable if o in primary) or Counter({"inf/nan": len(fixable)})
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
    fix = plugin_fix(figures, fp32_modules=islands)
    new = [i for i in islands if i not in given]
    if watched and figures.auto_fix and new and all(i in figures.auto_islands for i in new):
        # auto_islands ran them in float32 in this run: what followed is measured, and the plugin's line is the fix
        last = max((o.step for o in fixable if o.step is not None), default=-1)
        after = [o for o in _known_origins(figures, unnamed=True) if o.phase is Phase.FORWARD and (o.step or 0) > last]
        said = (
            f". `auto_islands=True` ran {'it' if len(modules) == 1 else 'them'} in float32 from the step after each"
            " was named: "
            + (
                f"{len(after)} skipped updates were born in forward after the last."
                if after
                else "no skipped update was born in forward after the last (measured in this run)."
            )
            + " For the next run, from its first step:"
        )
        fix = figures.auto_fix
    elif watched:
        said = (
            f" (watched: nothing measured whether float32 avoids them). Run {'it' if len(modules) == 1 else 'them'}"
            " in float32: a float16 overflow ends there; if they are born there again, float32 makes them too, and"
            ' the advisor says so. `NaNSkipReporter(find_origin="replay")` measures it in the run, by running'
            f" the module again{_auto_too(figures)}.{took}"
        )
    else:
        said = f": {whose} overflows float16{also}.{took} A replay with these islands computed finite values."
    if apart:
        where += f" of {told_skips(figures, len(origins))}, a problem apart from what explains the others"
    else:
        where += f" of {told_skips(figures, len(origins))}"
    return Advice(
        "fp32_module",
        f"Non-finite values were born in {where} ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}){said}",
        fix,
        {
            "module": module,
            "skips": len(fixable),
            "told": len(origins),
            "kinds": dict(kinds),
            "islands": islands,
            "measured": not watched,
            **({"modules": dict(modules)} if len(modules) > 1 else {}),
        },
        _explains(figures, fixable),
    )


def _auto_too(figures: RunFigures) -> str:
    """The one-run way to the islands, said beside the replay where the run did not use it."""
    if figures.plugin_args.get("auto_islands"):
        return ""
    return (
        "; `auto_islands=True` finds them in one run, by observation: each module named runs in float32 from the"
        " next step, and a consumer its float32 output overflows joins"
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
            f"{where} {len(precision)} of {told_skips(figures, len(origins))}, and the step rerun in float32 is finite"
            " while under bfloat16 it is not (or that could not be run): float16 loses the precision there (a"
            " difference of close values, a division by it), not its range, so neither bf16 nor a loss scale"
            f" fixes it.{said}",
            plugin_fix(figures, fp32_modules=[*_given_islands(figures), *islands])
            if islands
            else "# compute that code, and the module outputs it takes in, in float32 (`fp32_modules=[...]`)",
            {"own_code": len(precision), "told": len(origins), "islands": islands or None},
            _explains(figures, precision),
        )
    if not most(len(unread), len(origins), least=2):
        return None
    kinds = Counter(o.kind for o in unread)
    return Advice(
        "own_code",
        f"{where} {len(unread)} of {told_skips(figures, len(origins))}"
        f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}). No replay reads that code, so nothing this"
        " run measured tells a float16 overflow there (bf16 fixes that) from inf/nan the code makes in any"
        f" precision (a log, sqrt or division of 0: only a code fix does).{_batch_too(unread)}",
        "NaNSkipReporter(backward_origin=True)  # runs your step again on skips, in float32: which of the two",
        {"own_code": len(unread), "told": len(origins), "kinds": dict(kinds)},
        _explains(figures, unread),
    )
