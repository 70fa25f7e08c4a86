"""Verdict: where a skipped update's inf/nan were born, read from what was observed (or replayed). One reading.

:func:`first_born` finds, in a trace's events, the first place inf/nan appear: a call's output (born in that
module) or a call's inputs (made by the code around it: the enclosing module's own code, else the step's own code
or the batch). :func:`tell` turns that, the batch and the losses into an :class:`Origin`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_amp_plus.forensics._tree import values
from lightning_amp_plus.forensics.observe import _mask_like, nonfinite_kind, nonfinite_kinds
from lightning_amp_plus.forensics.origin import IN_ISLAND, OWN_CODE, WATCHING, Origin, Phase, Verdict


def first_born(events: list[tuple[Any, ...]], minus: bool = False) -> Optional[tuple[Optional[int], str, int]]:
    """The module inf/nan were born in, their kind and the event's position; None where every call was finite.

    A call's output holding ``+inf`` or NaN, its inputs not: born in it (inner modules end first: the innermost). A
    call's inputs holding them: made by the code around it, the enclosing module's (its index) or, at the top, the
    step's own code or the batch (None). A half-precision ``-inf`` counts only where a later call turns it into
    ``+inf`` or NaN (a mask or a bias made in float16 is no overflow): born where it appeared, the latest module
    whose output held it first, else the code that handed it to a call. A ``-inf`` alone counts at the top only, with
    ``minus`` (the batch holds one).
    """
    calls: list[int] = []  # the calls in progress
    took: list[bool] = []  # whether each took a half-precision -inf in
    minus16: Optional[tuple[Optional[int], int]] = None  # where a half-precision -inf appeared, and the event
    for position, (index, kind, *_) in enumerate(events):
        if kind == "-inf":
            kind = "inf" if minus and index >= 0 and not calls else None
        if index >= 0:
            if kind is not None and kind != "-inf16":
                return (calls[-1] if calls else None), kind, position
            if kind == "-inf16" and minus16 is None:
                minus16 = (calls[-1] if calls else None), position
            calls.append(index)
            took.append(kind == "-inf16")
        else:
            fed = took.pop() if took else False
            if calls:
                calls.pop()
            if kind == "-inf16" and not fed:
                minus16 = ~index, position
            elif kind is not None and kind != "-inf16":
                return (minus16[0], "inf", minus16[1]) if fed and minus16 else (~index, kind, position)
    return None


def tell(
    batch: Any,
    losses: list[Tensor],
    events: Optional[list[tuple[Any, ...]]],
    names: list[str],
    islands: list[str],
    accumulating: bool = False,
    unwatched: str = WATCHING,
) -> Optional[Origin]:
    """The origin a skip's batch, losses and watched events (None: not watched) support; None when not told.

    Not watched: the batch (it and the loss held inf/nan) or forward (the loss alone), their ``reason``
    ``unwatched`` (:data:`WATCHING`: the watch starts); backward (the loss finite). Watched: the batch's inf/nan
    reaching a module, the step's own code (:data:`OWN_CODE`), the module they were born in (``float32`` nonfinite
    where it ran in an fp32 island), the loss, backward.
    """
    in_batch = nonfinite_kinds(batch, masks=True, minus=True)  # an additive mask's -inf is no bad data
    loss = next((kind for kind in (nonfinite_kind(loss.detach()) for loss in losses) if kind), None)
    minus = "-inf" in in_batch
    in_batch.discard("-inf")
    if events is None:
        if loss is not None:
            return (
                Origin(Phase.INPUT, reason=unwatched)
                if in_batch
                else Origin(Phase.FORWARD, kind=loss, reason=unwatched)
            )
        if accumulating:
            return None  # an earlier micro-batch of the update may have made them: not recorded
        return Origin(Phase.BACKWARD, batch_too=bool(in_batch))  # no watch: the scale calibrates this way
    found = first_born(events, minus)
    if found is not None:
        index, kind, position = found
        if index is None:  # the batch's only where they can be its own (a batch tensor, or its samples carried on)
            if kind in in_batch and _from_batch(batch, events[position][2], minus):
                return Origin(Phase.INPUT)
            return Origin(Phase.FORWARD, OWN_CODE, kind, batch_too=kind in in_batch)
        name = names[index]
        if any(name == i or name.startswith(i + ".") for i in islands):  # it ran in float32: measured by the run
            return Origin(Phase.FORWARD, name, kind, float32=Verdict.NONFINITE, reason=IN_ISLAND)
        return Origin(Phase.FORWARD, name, kind)
    if loss is not None:  # the batch holding inf/nan is said: it may have reached the loss (a target)
        return Origin(Phase.LOSS, batch_too=bool(nonfinite_kinds(batch)))
    return None if accumulating else Origin(Phase.BACKWARD, batch_too=bool(in_batch))


def _from_batch(batch: Any, tops: list[tuple[Any, ...]], minus: bool) -> bool:
    """Whether the inf/nan the step handed a module can be the batch's.

    Yes for a batch tensor (or a view of one) holding them, or where each tensor holding them holds them only at
    samples where the batch does (the step's code carries a sample on in its sample).
    """
    counted = ("inf", "nan", "-inf16", "-inf") if minus else ("inf", "nan", "-inf16")
    told = [(p, {i for i, k in enumerate(kinds) if k in counted}, len(kinds)) for p, kinds in tops]
    told = [t for t in told if t[1]]
    bad = [t.detach() for t in values(batch) if t.is_floating_point() and nonfinite_kinds(t, masks=True)]
    if any(pointer == t.untyped_storage().data_ptr() for pointer, _, _ in told for t in bad):
        return True
    samples: dict[int, set[int]] = {}
    for t in (t for t in bad if t.dim()):
        flags = torch.isnan(t) | torch.isposinf(t) | (torch.isneginf(t) & (not _mask_like(t)))
        samples.setdefault(t.shape[0], set()).update(flags.reshape(len(t), -1).any(1).nonzero().flatten().tolist())
    return bool(told) and all(n in samples and rows <= samples[n] for _, rows, n in told)


#: how much an origin tells, most first: a rank that saw the inf/nan born outranks one whose forward was finite
_TELLING = [Phase.INPUT, Phase.LOSS, Phase.FORWARD, Phase.BACKWARD, Phase.UNKNOWN]


def job_origin(per_rank: list[Optional[Origin]]) -> Optional[Origin]:
    """One skipped update's origin from every rank's: the most telling, with its ``rank`` (the others say backward).

    Example:
        >>> job_origin([Origin(Phase.BACKWARD), Origin(Phase.INPUT)]).to_dict()
        {'phase': 'input', 'rank': 1}
    """
    told = [(_TELLING.index(o.phase), o.unnamed, rank, o) for rank, o in enumerate(per_rank) if o]
    if len(per_rank) == 1 or not told:
        return told[0][3] if told else None
    *_, rank, origin = min(told, key=lambda found: found[:3])
    return origin.but(rank=rank)
