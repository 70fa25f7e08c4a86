"""Who hears an update: :class:`UpdateListener` (a part overrides what it needs) and :class:`SkipEvent`.

Torch only, no other module of the package: the engine tells listeners, the callbacks and 0.2's compatibility lists
are listeners.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.optim import Optimizer


@dataclass
class SkipEvent:
    """A skipped update, as handed to :meth:`UpdateListener.update_skipped`.

    Gradients are still in place (unscaled) when listeners run, so they can be inspected. ``consecutive`` is the
    number of updates skipped in a row ending with this one (:meth:`ScaleHistory.streak_at`).
    """

    step: int
    scale: float
    new_scale: float
    optimizers: list[Optimizer] = field(default_factory=list)
    consecutive: int = 1


class UpdateListener:
    """A part that listens to the engine's updates (``engine.listen(part)``): it overrides what it needs.

    The engine calls only what a listener overrides, so a hook it does not need costs nothing on any step. Whether a
    fused optimizer's skip must be read on the host at its step (one sync per step) follows from who listens.
    """

    #: each skip must be known on the host at its step: a fused optimizer's flag is read then (one host sync a step)
    needs_host_skips = False

    def step_starting(self) -> None:
        """Just before each ``training_step`` call: every hook before it (the LightningModule's too) has run.

        A closure optimizer (LBFGS) evaluates the step several times a batch: each evaluation is a call.
        """

    def before_unscale(self, optimizer: Optimizer, step: int) -> None:
        """Just before ``optimizer``'s gradients are unscaled at update ``step`` (16-mixed): they are still scaled."""

    def skipped_step(self, optimizer: Optimizer) -> None:
        """Right after a step the host knows was skipped, its gradients still the ones the step refused."""

    def update_skipped(self, event: SkipEvent) -> None:
        """An update closed skipped, and the host knows it (see :class:`SkipEvent`)."""
