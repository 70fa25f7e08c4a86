"""Verdict: where a skipped update's inf/nan were born, read from what was observed (or replayed). One reading.

:func:`first_born` finds, in a trace's events, the first place inf/nan appear: a call's output (born in that
module) or a call's inputs (made by the code around it: the enclosing module's own code, else the step's own code
or the batch). :func:`read_origin` turns that, the batch and the losses into an :class:`Origin`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_amp_plus._limits import GRAPH_NODES
from lightning_amp_plus.forensics._tree import values
from lightning_amp_plus.forensics.observe import SEQUENCED, _mask_like, nonfinite_kind, nonfinite_kinds
from lightning_amp_plus.forensics.origin import IN_ISLAND, OWN_CODE, WATCHING, Origin, Phase, Verdict
from lightning_amp_plus.islands import island_of


class Born(NamedTuple):
    """Where :func:`first_born` found inf/nan born.

    The module's index (None: the step's own code or the batch), their kind, the event's position, and the module
    whose half-precision ``-inf`` the call took (``fed_by``) and its event.
    """

    call: Optional[int]
    kind: str
    position: int
    fed_by: Optional[int] = None
    fed_at: Optional[int] = None
    #: the modules that made a float32 ``-inf`` before the call took one (a ``log(0)``), and their events
    minus32: tuple[tuple[int, int], ...] = ()

    @property
    def start(self) -> int:
        """The first event of what made them: the ``-inf``'s maker where the call was fed one."""
        return self.fed_at if self.fed_at is not None else self.position


def first_born(
    events: list[tuple[Any, ...]],
    minus: bool = False,
    to_loss: bool = False,
    in_loss: Optional[Callable[[int], bool]] = None,
) -> Optional[Born]:
    """Where inf/nan were first born in a trace's events; None where every call was finite.

    A call's output holding ``+inf`` or NaN, its inputs not: born in it (inner modules end first: the innermost). A
    call's inputs holding them: made by the code around it, the enclosing module's (its index) or, at the top, the
    step's own code or the batch (None). A ``-inf`` alone counts at the top only, with ``minus`` (the batch holds one).

    A half-precision ``-inf`` is no overflow by itself (a mask or a bias made in float16). A call that takes one and
    makes ``+inf`` or NaN is born in, ``fed_by`` the innermost module whose output held it first, the latest such
    (a mask there, or an overflow to ``-inf``: observation cannot tell, and a fix runs both in float32); where the code
    around a call made it, that code is named (no island holds it).

    The output of a module with forward hooks of its own is read before they acted: its ``+inf``/NaN count where a
    later call takes them or a call around it gives them (:func:`_reaches`); one a hook cleaned does not.

    ``to_loss``: the loss is inf (not NaN) and nothing else was born: a module's half-precision ``-inf`` no later call
    took went to the loss, born in that module (a head that overflows to ``-inf``; float32 there tells a mask apart).

    ``in_loss``: whether an autograd node (its sequence number) is in the losses' graphs. An output whose +inf/NaN
    tensors all have a graph the loss never used (a router's unused sentinel), followed by another call's own
    overflow, does not count: that call is named (:func:`_unused`).
    """
    calls: list[int] = []  # the calls in progress
    opened: list[int] = []  # the event each of them started at
    took: list[bool] = []  # whether each took a half-precision -inf in
    maker: Optional[tuple[bool, Optional[int], int]] = None  # where one appeared: made by a module?, which, the event
    taken = False  # a later call took the -inf its maker made
    took32: list[bool] = []  # whether each took a float32 -inf in (not the batch's)
    makers32: list[tuple[int, int]] = []  # the modules that made one from inputs without: which, the event
    for position, (index, kind, *rest) in enumerate(events):
        minus32 = kind == "-inf"
        if minus32:
            kind = "inf" if minus and index >= 0 and not calls else None
        if index >= 0:
            if kind is not None and kind != "-inf16":
                return Born(calls[-1] if calls else None, kind, position)
            if kind == "-inf16" and maker is None:
                maker = False, calls[-1] if calls else None, position
            elif kind == "-inf16":
                taken = True
            calls.append(index)
            opened.append(position)
            took.append(kind == "-inf16")
            took32.append(minus32 and kind is None)
        else:
            fed = (took.pop() if took else False) and maker is not None
            in32 = took32.pop() if took32 else False
            start = opened.pop() if opened else -1
            if calls:
                calls.pop()
            inside = maker is not None and maker[0] and maker[2] > start  # made by a module inside this call
            if kind == "-inf16" and not fed and not inside:
                maker, taken = (True, ~index, position), False
            elif minus32 and not in32:
                makers32.append((~index, position))
            elif kind is not None and kind != "-inf16":
                if not fed:
                    hooked, bad = rest[1], rest[2]
                    if hooked and not _reaches(events, position, calls):
                        continue  # read before your hook acted, and it reached nothing: the hook cleaned it
                    if not hooked and _unused(events, position, calls, bad, in_loss):
                        continue
                    # the module whose float32 -inf this call took in, if one made it (read_origin: at a point op,
                    # a log of 0, the model's own; a mask, no: this call is named, as its overflow may be)
                    return Born(~index, kind, position, minus32=tuple(makers32) if in32 else ())
                by_module, by, at = maker  # type: ignore[misc]
                return Born(~index, kind, position, by, at) if by_module else Born(by, "inf", at)
    if to_loss and maker is not None and maker[0] and not taken:
        return Born(maker[1], "inf", maker[2])
    return None


#: the kind a module's output must hold to be born beside another (``also``): an overflow; a NaN from finite inputs
#: is as often the model's own, in any precision
ALSO_KIND = "inf"


def joins_also(origin: Origin) -> bool:
    """Whether ``origin``, told apart (an earlier micro-batch of the update), joins another's ``also``.

    :func:`also_born`'s rule: an overflow (:data:`ALSO_KIND`) in a named module that no island measured NaN in.
    """
    return origin.phase is Phase.FORWARD and bool(origin.name) and origin.kind == ALSO_KIND and origin.float32 is None


def also_born(events: list[tuple[Any, ...]], after: int, in_loss: Optional[Callable[[int], bool]] = None) -> list[int]:
    """The modules where ``+inf`` was born on their own after the event ``after`` (the first birth's), in order.

    Stricter than the first birth, which already explains the skip: a call whose inputs were all finite (no mask's
    ``-inf`` either), inside which nothing held inf/nan, whose output holds ``+inf`` (a float16 overflow; a NaN from
    finite inputs is as often the model's own, in any precision), and which the loss used (one of those tensors is
    in the loss's graph, where this torch tells; an output with no graph, a teacher's, is not counted). A second
    tower that overflowed in the same step. A call that took the first birth's values (or any) is fed, not born.

    Example (events as :func:`~.observe.read` gives them: a call's start, its end as ``~index``):

        >>> finite, born = (0, None, [], False, ()), (~0, "inf", [], False, ())
        >>> also_born([finite, born, (1, None, [], False, ()), (~1, "inf", [], False, ())], after=1)
        [1]
        >>> also_born([finite, born, (1, "inf", [], False, ()), (~1, "inf", [], False, ())], after=1)
        []
        >>> also_born([finite, born, (1, "-inf", [], False, ()), (~1, "inf", [], False, ())], after=1)
        []
        >>> also_born([finite, born, (1, None, [], False, ()), (~1, "nan", [], False, ())], after=1)
        []
    """
    found: list[int] = []
    calls: list[int] = []  # the calls in progress
    clean: list[bool] = []  # whether each is still a candidate: its inputs finite, nothing inside held inf/nan
    for position, (index, kind, *rest) in enumerate(events):
        bad = kind in ("inf", "nan")
        if index >= 0:
            calls.append(index)
            clean.append(position > after and kind is None)
            if bad:  # a call took them: every call around it gives what it took
                clean[:] = [False] * len(clean)
            continue
        was_clean = clean.pop() if clean else False
        if calls:
            calls.pop()
        if not bad:
            continue
        if was_clean and kind == ALSO_KIND and position > after:
            hooked, nodes = (rest[1], rest[2]) if len(rest) > 2 else (False, ())
            used = in_loss is None or any(n is not None and in_loss(n) for n in nodes)
            if used and not (hooked and not _reaches(events, position, calls)):
                found.append(~index)
        clean[:] = [False] * len(clean)  # the calls around it give what it made
    return list(dict.fromkeys(found))


def _reaches(events: list[tuple[Any, ...]], position: int, around: list[int]) -> bool:
    """Whether the ``+inf``/NaN the call ending at ``position`` gave reach a later call (:func:`first_born`).

    Asked of a module with forward hooks of its own: its output was read before they acted (one may have cleaned
    it). ``around``: the calls in progress around it. The first event after it holding them decides: a call's inputs
    or the output of a call around it, yes; another call's output (born there) or none, no.

    Not asked of other modules: an output the step's own code hands to the loss (a teacher's target) holds the same
    events as an unused one (a router's +inf sentinel); for them the loss's graph tells (:func:`_unused`).
    """
    for index, kind, *_ in events[position + 1 :]:
        if kind in ("inf", "nan"):
            return index >= 0 or ~index in around
    return False


def _unused(
    events: list[tuple[Any, ...]],
    position: int,
    around: list[int],
    bad: tuple[Optional[int], ...],
    in_loss: Optional[Callable[[int], bool]],
) -> bool:
    """Whether an output's +inf/NaN went unused, so that another call explains the loss.

    Every tensor holding them has a graph the loss never used, and the next event holding them is another call's
    output, born there.

    An output without a graph (a teacher under ``inference_mode``, a detached value) cannot be told: it counts.
    """
    if in_loss is None or not bad or any(node is None or in_loss(node) for node in bad):
        return False
    for index, kind, *_ in events[position + 1 :]:
        if kind in ("inf", "nan"):
            return index < 0 and ~index not in around
    return False


class LossGraph:
    """The losses' autograd graphs, by node sequence number: read once, when first asked, and only on a skip.

    Node names and numbers only: after backward autograd keeps no value, and nothing runs. ``limit`` nodes at most
    (a graph larger than that: every node counts as used).
    """

    def __init__(self, losses: list[Tensor], limit: int = GRAPH_NODES) -> None:
        self._losses, self._limit = losses, limit
        self._nodes: Optional[dict[int, Any]] = None
        self._complete = True

    def _read(self) -> dict[int, Any]:
        if self._nodes is None:
            self._nodes = {}
            stack: list[Any] = [loss.grad_fn for loss in self._losses if loss.grad_fn is not None]
            while stack:
                step = stack.pop()
                if step is None or step._sequence_nr() in self._nodes:
                    continue
                if len(self._nodes) >= self._limit:
                    self._complete = False
                    break
                self._nodes[step._sequence_nr()] = step
                stack.extend(f for f, _ in step.next_functions)
        return self._nodes

    def __call__(self, node: int) -> bool:
        """Whether the node is in the graphs (the loss used what it made)."""
        return node in self._read() or not self._complete

    def op_at(self, node: int, ops: frozenset[str]) -> Optional[str]:
        """The op among ``ops`` that made ``node``'s ``-inf``; None where another op made it (a ``masked_fill``).

        Read down from the node through casts and views (:data:`_PASSING`), and through arithmetic
        (:data:`_ARITHMETIC`: ``(log(e) - 1) / 2``, ``log(e) * w``) by its first operand, which passes a ``-inf``
        on; the first other op made it. A division whose numerator made none is read as that numerator's (``x / 0``
        falls back to the call that took it: an island, never a wrong "the model's own").
        """
        step = self._read().get(node)
        for _ in range(_NODES):  # a chain of views that long: no maker told
            if step is None:
                break
            name = type(step).__name__
            operands = [f for f, _ in step.next_functions]
            inputs = [f for f in operands if f is not None]
            if inputs and (name in _PASSING or name.split("Backward")[0] in _ARITHMETIC):
                step = operands[0] if operands[0] is not None else inputs[0]
                continue
            return name if name.split("Backward")[0] in ops else None
        return None

    def under(self, tops: tuple[Optional[int], ...]) -> set[int]:
        """The nodes ``tops``' values were computed from, themselves included.

        One walk of the graphs read (at most ``limit`` nodes: a long sequence's steps included).
        """
        nodes = self._read()
        stack, seen = [top for top in tops if top is not None and top in nodes], set[int]()
        while stack:
            number = stack.pop()
            if number in seen:
                continue
            seen.add(number)
            # within the nodes read: torch crashes freeing a graph read deeper (_limits.GRAPH_NODES)
            following = (f._sequence_nr() for f, _ in nodes[number].next_functions if f is not None)
            stack.extend(n for n in following if n in nodes)
        return seen

    def op_in(self, node: Optional[int], ops: frozenset[str], within: int = 32) -> Optional[str]:
        """The nearest op among ``ops`` (``"Sqrt"``) at or below ``node`` (a module's output), ``within`` nodes."""
        start = self._read().get(node) if node is not None else None
        queue, seen = [start], 0
        while queue and seen < within:
            step = queue.pop(0)
            if step is None:
                continue
            seen += 1
            name = type(step).__name__.split("Backward")[0]
            if name in ops:
                return type(step).__name__
            queue.extend(f for f, _ in step.next_functions)
        return None


#: the nodes a value passes through unchanged in kind (a cast, a view): :meth:`LossGraph.op_at` looks below them
_PASSING = frozenset(
    {"ToCopyBackward0", "NegBackward0", "CloneBackward0", "ViewBackward0", "UnsafeViewBackward0"}
    | {"ReshapeAliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"}
    | {"TransposeBackward0", "PermuteBackward0", "TBackward0", "ExpandBackward0", "AsStridedBackward0"}
    | {"SliceBackward0", "SelectBackward0", "IndexBackward0", "SplitBackward0", "SplitWithSizesBackward0"}
    | {"UnbindBackward0", "NarrowBackward0", "AliasBackward0"}
)
#: arithmetic :meth:`LossGraph.op_at` reads through by its first operand (it passes that operand's ``-inf`` on)
_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Rsub", "Neg"})

#: the ops that make inf/nan at a point, by their backward node's name (a forward origin's op: its guard)
POINT_OPS = frozenset({"Sqrt", "Log", "Div", "Pow", "Rsqrt", "Acos", "Asin", "Atan2", "Log2", "Log10", "Reciprocal"})


def read_origin(
    batch: Any,
    losses: list[Tensor],
    events: Optional[list[tuple[Any, ...]]],
    names: list[str],
    islands: list[str],
    accumulating: bool = False,
    unwatched: str = WATCHING,
    loss_modules: frozenset[str] = frozenset(),
) -> Optional[Origin]:
    """The origin a skip's batch, losses and watched events (None: not watched) support; None when not told.

    Not watched: the batch (it and the loss held inf/nan) or forward (the loss alone), their ``reason``
    ``unwatched`` (:data:`WATCHING`: the watch starts); backward (the loss finite). Watched: the batch's inf/nan
    reaching a module, the step's own code (:data:`OWN_CODE`), the module they were born in (``float32`` nonfinite
    where it ran in an fp32 island), the loss (a torch loss module's output too: ``loss_modules``), backward.
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
    if loss is None:  # the loss finite: born in backward, whatever a module gave (phases as the docs define them)
        return None if accumulating else Origin(Phase.BACKWARD, batch_too=bool(in_batch))
    to_loss = loss == "inf"  # a NaN loss (an all-masked softmax in the step's code) names no -inf maker
    graph = LossGraph(losses) if SEQUENCED else None
    found = first_born(events, minus, to_loss, graph)
    if found is not None:
        index, kind, position, fed_by, _, minus32 = found
        if index is None:  # the batch's only where they can be its own (a batch tensor, or its samples carried on)
            if kind in in_batch and _from_batch(batch, events[position][2], minus):
                return Origin(Phase.INPUT)
            return Origin(Phase.FORWARD, OWN_CODE, kind, batch_too=kind in in_batch)
        name, by = names[index], names[fed_by] if fed_by is not None else None
        if name in loss_modules and by is not None and by not in loss_modules:
            # a loss module fed a module's float16 -inf (a head that overflows to -inf): born in that module, as with
            # a functional loss (the loss module is never an island)
            if island_of(by, islands):
                return Origin(Phase.FORWARD, by, "inf", float32=Verdict.NONFINITE, reason=IN_ISLAND)
            return Origin(Phase.FORWARD, by, "inf")
        if name in loss_modules:  # a loss computed by a module (`self.criterion`): the loss, never an island
            return Origin(Phase.LOSS, op=log_of(losses), batch_too=bool(nonfinite_kinds(batch)))
        # a module made -inf in float32 at a point op (a log of 0) and this call turned it into +inf/NaN: the model's
        # own, at that op (a mask made -inf by masked_fill is no point op: the call is named, as its overflow may be)
        made = _minus32_maker(events, graph, position, minus32)
        if made is not None:
            said = f"its float32 -inf became {kind} in {name}: float32 makes them too"
            return Origin(
                Phase.FORWARD, names[made[0]], "-inf", float32=Verdict.NONFINITE, reason=said[:200], op=made[1]
            )
        # the op in it that makes them at a point (a sqrt of a negative): its input is what a guard fixes
        bad = events[position][4] if len(events[position]) > 4 else ()
        op = graph.op_in(bad[0], POINT_OPS) if graph is not None and bad else None
        # a second module that overflowed on its own in the same step (three towers): one run names them all
        also = tuple(
            n
            for n in (names[i] for i in also_born(events, position, graph))
            if n != name and n != by and n not in loss_modules and not island_of(n, islands)
        )
        if island_of(name, islands) and (by is None or island_of(by, islands)):  # float32 made them: the run says
            return Origin(Phase.FORWARD, name, kind, float32=Verdict.NONFINITE, reason=IN_ISLAND, op=op, also=also)
        return Origin(Phase.FORWARD, name, kind, fed_by=by, op=op, also=also)
    if loss is not None:  # the batch holding inf/nan is said: it may have reached the loss (a target)
        return Origin(Phase.LOSS, op=log_of(losses), batch_too=bool(nonfinite_kinds(batch)))
    return None if accumulating else Origin(Phase.BACKWARD, batch_too=bool(in_batch))


def _minus32_maker(
    events: list[tuple[Any, ...]], graph: Optional[LossGraph], position: int, makers: tuple[tuple[int, int], ...]
) -> Optional[tuple[int, str]]:
    """The module (and its op) whose float32 ``-inf`` the call at ``position`` turned into +inf/NaN; None: not told.

    Told where a point op made it (:meth:`LossGraph.op_at`): a mask's, or a maker the graph cannot tell, is not. The
    latest maker whose output the call's output was computed from (:meth:`LossGraph.under`, one walk).
    """
    if graph is None or not makers:
        return None
    under = graph.under(events[position][4] if len(events[position]) > 4 else ())
    for made, at in reversed(makers):
        node = events[at][4][0] if len(events[at]) > 4 and events[at][4] else None
        if node is not None and node in under:
            op = graph.op_at(node, POINT_OPS)
            return (made, op) if op is not None else None
    return None


#: the ops that saturate in half precision, by the autograd node they leave: a log of their output is log(0)
_SATURATING = {"SigmoidBackward0": "log(sigmoid)", "SoftmaxBackward0": "log(softmax)"}
#: the nodes a saturated value passes through on its way to the log (``1 - p``, a cast, a clamp that keeps 0)
_ON_THE_WAY = frozenset(
    {"RsubBackward1", "RsubBackward0", "NegBackward0", "ToCopyBackward0", "SubBackward0", "ClampMinBackward0"}
    | {"ClampBackward1"}
)
#: a node on the way where its other input is a constant (``p + 1e-8``: the loss was inf, so the eps did not help;
#: 1e-8 is 0 in float16)
_WITH_A_CONSTANT = frozenset({"AddBackward0", "AddBackward1"})
#: the loss graph's nodes read at most (names only: after backward, autograd keeps no value)
_NODES = 2000


def _half_output(node: Any) -> bool:
    """Whether a backward node's op gave a half-precision output (its gradient's metadata: names, no value).

    A torch without the metadata (2.4): the graph's shape tells, and a cast just below the op (``x.float()``) says
    it ran in float32 (or cannot be told): not named.
    """
    try:
        return node._input_metadata[0].dtype in (torch.float16, torch.bfloat16)
    except Exception:  # noqa: BLE001 - a torch without the metadata
        below = node.next_functions[0][0] if node.next_functions else None
        return below is None or type(below).__name__ != "ToCopyBackward0"


def log_of(losses: list[Tensor]) -> Optional[str]:
    """``"log(sigmoid)"`` or ``"log(softmax)"`` where a loss's code takes the log of a saturating op's output.

    Read from the losses' autograd graphs by node names and output dtypes alone (torch's metadata, no value, nothing
    run): a float16 sigmoid saturates at 1 (``log(1 - p)`` is ``log(0)``), a float16 softmax rounds to 0. None: no
    such log (a sigmoid in float32 is not one).

    Example:
        >>> logits = torch.tensor([12.0], dtype=torch.float16, requires_grad=True)
        >>> log_of([-(1 - torch.sigmoid(logits)).log().float().mean()])
        'log(sigmoid)'
        >>> log_of([-torch.log(1 - torch.sigmoid(logits) + 1e-8).float().mean()])  # 1e-8 is 0 in float16
        'log(sigmoid)'
        >>> log_of([-torch.log(1 - torch.sigmoid(logits.float())).mean()]) is None  # float32's sigmoid: not this
        True
    """
    seen: set[Any] = set()
    stack: list[Any] = [loss.grad_fn for loss in losses if loss.grad_fn is not None]
    while stack and len(seen) < _NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "LogBackward0":
            found = node.next_functions[0][0] if node.next_functions else None
            for _ in range(4):  # through `1 - p`, `+ eps`, a clamp, a cast
                if found is None:
                    break
                name = type(found).__name__
                constant = name in _WITH_A_CONSTANT and any(f is None for f, _ in found.next_functions)
                if name not in _ON_THE_WAY and not constant:
                    break
                found = found.next_functions[0][0] if found.next_functions else None
            if found is not None and type(found).__name__ in _SATURATING and _half_output(found):
                return _SATURATING[type(found).__name__]
        stack.extend(f for f, _ in node.next_functions)
    return None


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
    return origin.replace(rank=rank)
