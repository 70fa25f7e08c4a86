"""fp32 islands found by observation: ``AmpPlusPrecision(auto_islands=True)``.

Torch only. :class:`AutoIslands` listens to the plugin's updates with an :class:`~.forensics.finder.OriginFinder` of
its own, watched lazily as ``NaNSkipReporter``'s is: nothing before the first skip whose loss held inf/nan, then
every module (the watch's global hooks, nothing stored on your modules). On a skip born in a named module's forward
(its inputs finite, inf/nan out) that module runs in float32 from the next step. An island whose float32 output
overflows its consumer makes the consumer the birthplace of the next skip, so the consumer joins the same way. A
module that makes inf/nan again as an island is taken out: float32 makes them too, the model's own.

Nothing of your code runs a second time: the skip that names a module is skipped as always, the island acts from the
next step. :func:`island_change` is the one rule; the plugin installs what it says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_amp_plus._ranks import distributed
from lightning_amp_plus.forensics._modules import walk
from lightning_amp_plus.forensics.finder import OriginFinder
from lightning_amp_plus.forensics.origin import Origin, Phase, Verdict
from lightning_amp_plus.forensics.verdict import job_origin
from lightning_amp_plus.islands import island_of
from lightning_amp_plus.listener import SkipEvent, UpdateListener


@dataclasses.dataclass(frozen=True)
class Change:
    """What one skip changes: the modules that run in float32 from the next step, and the island taken out."""

    added: tuple[str, ...] = ()
    taken_out: Optional[str] = None

    def __bool__(self) -> bool:
        return bool(self.added or self.taken_out)


def island_change(origin: Optional[Origin], islands: list[str], added: list[str], own: set[str]) -> Change:
    """The one rule: what a skip's ``origin`` changes, given the ``islands`` running (``added``: ours among them).

    A forward origin in a named module outside every island adds that module (and the module whose half-precision
    ``-inf`` it took, ``fed_by``; those born on their own in the same step, ``also``). One inside an island we added
    (float32 made them too) takes that island out; a module taken out (in ``own``) is never added again. Anything
    else (the batch, the loss, backward, the step's own code, a forward not yet named) changes nothing.

    Example:
        >>> born = Origin(Phase.FORWARD, "pool", "inf")
        >>> island_change(born, [], [], set())
        Change(added=('pool',), taken_out=None)
        >>> again = Origin(Phase.FORWARD, "pool", "nan", float32=Verdict.NONFINITE)
        >>> island_change(again, ["pool"], ["pool"], set())
        Change(added=(), taken_out='pool')
    """
    if origin is None or origin.phase is not Phase.FORWARD or not origin.name:
        return Change()
    nonfinite = origin.float32 is Verdict.NONFINITE
    island = island_of(origin.name, islands) if nonfinite else None
    # `also`: born on their own in the same step (beside an island float32 made them in too)
    born = origin.also if nonfinite else (origin.fed_by, origin.name, *origin.also)
    names = [n for n in born if n and n not in own and island_of(n, islands) is None]
    return Change(added=tuple(dict.fromkeys(names)), taken_out=island if island in added else None)


class AutoIslands(UpdateListener):
    """The plugin's observer for ``auto_islands=True``: a finder of its own, and the islands it added.

    ``install(name)`` / ``take_out(name)`` put an island on or off the model (the plugin's); ``say(line)`` says a
    change; ``count(n, step)`` logs the islands' count. ``added`` and ``own`` are kept in checkpoints.
    """

    #: a fused optimizer's skip is read at its step: an island acts from the next step (one host sync a step)
    needs_host_skips = True

    def __init__(
        self,
        islands: Callable[[], list[str]],
        install: Callable[[str], Optional[str]],
        take_out: Callable[[str], None],
        say: Callable[[str], None],
        count: Callable[[int, int], None],
    ) -> None:
        self.finder = OriginFinder()
        self.added: list[str] = []  # the islands observation added, in order (the user's own are not here)
        self.own: list[str] = []  # taken out: float32 made inf/nan there too
        self.refused: dict[str, str] = {}  # could not be made an island, and why (told once)
        self.at_start: set[str] = set()  # the modules the model had when the fit started (a fix line can name them)
        #: this step's changes (cleared as the next step starts): a skip of this step is judged against the islands
        #: that ran in it (:meth:`as_run`), whatever order the listeners are called in
        self.fresh: list[str] = []
        self.out_now: list[str] = []
        self._islands, self._install, self._take_out, self._say, self._count = islands, install, take_out, say, count

    def reset(self) -> None:
        """A new run: nothing added yet."""
        self.added, self.own, self.refused, self.fresh, self.out_now = [], [], {}, [], []

    def attach(self, model: torch.nn.Module, context: Callable[[], Any], accumulating: bool) -> None:
        """Observe ``model`` (the LightningModule) from the next batch; watched after the first forward skip."""
        self.at_start = {seen.name for seen in walk(model)}
        said = self.finder.attach(model, context, islands=self._islands, accumulating=accumulating)
        if said is not None:
            self._say(said)

    def detach(self) -> None:
        """Take the watch off and forget the batch."""
        self.finder.detach()

    def as_run(self, islands: list[str]) -> list[str]:
        """``islands`` (running now) as they ran in this step: less those added at its skip, with those taken out."""
        return [*(n for n in islands if n not in self.fresh), *(n for n in self.out_now if n not in islands)]

    def step_starting(self) -> None:
        """A training step starts: the last one's record is dropped, this one's begun (its losses come later)."""
        self.fresh, self.out_now = [], []
        self.finder.take_batch()
        self.finder.start_batch(None)

    def loss(self, loss: torch.Tensor) -> None:
        """A loss about to be scaled for backward (read, detached, only on a skipped update)."""
        if self.finder.current is not None:
            self.finder.current.losses.append(loss)

    def update_skipped(self, event: SkipEvent) -> None:
        origin = self.finder.origin()
        if distributed():  # every rank skips the same updates: the rank that saw it born tells, all change alike
            gathered: list[Optional[Origin]] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, origin)
            origin = job_origin(gathered)
        said = self.finder.watch_if_asked(origin)
        if said is not None:
            self._say(said)
        change = island_change(origin, self._islands(), self.added, set(self.own))
        if change.taken_out is not None:
            self._take_out(change.taken_out)
            self.added.remove(change.taken_out)
            self.own.append(change.taken_out)
            self.out_now.append(change.taken_out)
            self._say(
                f"{change.taken_out!r} made {origin.kind if origin else 'inf/nan'} again in float32 at step"
                f" {event.step}: float32 makes them too (the model's own), so it runs in half precision again."
            )
        for name in change.added:
            if name in self.refused:
                continue
            why = self._install(name)
            if why is not None:
                self.refused[name] = why
                self._say(f"{name!r} overflowed at step {event.step} but cannot be made an island: {why}.")
                continue
            self.added += [] if name in self.added else [name]  # a replaced module: the same name, wrapped again
            self.fresh.append(name)
            assert origin is not None  # a change is made from a told origin
            if name == origin.fed_by:
                line = f"{name!r} gave {origin.name!r} a half-precision -inf at step {event.step} (mask or overflow)"
            else:
                line = f"{name!r} made {origin.kind or 'inf/nan'} in float16 at step {event.step} from finite inputs"
            self._say(f"{line}: it runs in float32 from the next step.")
        if change:
            self._count(len(self.added), event.step)

    def state_dict(self) -> dict[str, Any]:
        return {"added": list(self.added), "own": list(self.own)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run keeps the islands its checkpoint had (installed again where the model has them)."""
        self.own = [str(n) for n in state.get("own", [])]
        self.added = []
        for name in (str(n) for n in state.get("added", [])):
            why = self._install(name)
            if why is None:
                self.added.append(name)
            else:
                self.refused[name] = why
                self._say(f"{name!r} from the checkpoint cannot be made an island again: {why}.")
