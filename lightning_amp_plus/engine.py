"""AmpEngine: the update cycle and the one skip decision, shared by the Lightning and Fabric plugins (torch only).

One update (:class:`UpdateCycle`): ``begin`` -> ``unscale`` (once per optimizer) -> the caller's hooks and clipping
-> ``step`` (or skip) -> ``end_cycle`` (record in the history, update the scale once, tell the listeners). A cycle
may hold several optimizers (one backward, two optimizers; a GAN's two steps in one batch): the scale updates once,
at its end. The cycle's state is one object, made at ``begin`` and dropped whole at its end or on abort.

The skip decision has one interface for both precisions: 16-mixed uses the :class:`DynamicLossScaler`, bf16-mixed a
:class:`NonFiniteChecker` (a scaler whose scale is 1 and never moves), so fused optimizers, closures, ranks
(``sharded``) and the history work alike. "Skipped updates in a row" is counted in one place,
:meth:`ScaleHistory._take`; the plugin's streak warning, :class:`SkipEvent` and the callbacks read it.

The engine sees only real optimizers: the adapters resolve what users hold (``LightningOptimizer``, Fabric's
optimizer) where it enters (:func:`~lightning_amp_plus._identity.resolve_optimizer`).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import LBFGS, Optimizer

from lightning_amp_plus._compat import Deprecated
from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._log import global_rank, say
from lightning_amp_plus._repr import number, same_value
from lightning_amp_plus._validation import check_bool, check_choice, check_device, check_int
from lightning_amp_plus._warnings import warn_at_user
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.knobs import DEFAULTS, check_knobs
from lightning_amp_plus.listener import SkipEvent, UpdateListener
from lightning_amp_plus.scaler import (
    DynamicLossScaler,
    NonFiniteChecker,
    ShardedDynamicLossScaler,
    any_skipped,
)


def _overrides(listener: UpdateListener, name: str) -> bool:
    return getattr(type(listener), name) is not getattr(UpdateListener, name)


class UpdateCycle:
    """One update: the optimizer steps that share one scale update (made by ``begin``, dropped whole at its end).

    The engine keeps the open cycle and the one that closed last; the scaler keeps torch's per-optimizer state of the
    open one (its unscale stage and overflow flags), which :meth:`DynamicLossScaler.update` replaces whole.

    Attributes:
        step: the step the update is recorded at (in Lightning the logger's step, in Fabric the count of updates).
        unscaled: optimizers whose gradients were unscaled (checked, in bf16) in this cycle.
        stepped: optimizers that stepped (or skipped) in this cycle.
        skipped: once closed: whether it was skipped (``None``: a fused optimizer decided on the device, not read).
        leftover: once closed: optimizers unscaled that did not step (the next backward forgets their unscale).
    """

    __slots__ = ("leftover", "skipped", "step", "stepped", "unscaled")

    def __init__(self, step: int) -> None:
        self.step = step
        self.unscaled: list[Optimizer] = []
        self.stepped: list[Optimizer] = []
        self.skipped: Optional[bool] = False
        self.leftover: list[Optimizer] = []

    # optimizers define no __eq__: `in` is identity, in C (so callers test `o in cycle.unscaled` directly)
    def unscaled_not_stepped(self) -> list[Optimizer]:
        return [o for o in self.unscaled if o not in self.stepped]

    def __repr__(self) -> str:
        return f"UpdateCycle(step={self.step}, unscaled={len(self.unscaled)}, stepped={len(self.stepped)})"


class AmpEngine:
    """The scale/unscale/step/skip/record/update cycle, independent of any trainer.

    Args:
        precision: ``"16-mixed"`` (uses ``scaler``) or ``"bf16-mixed"`` (no scaler).
        scaler: the loss scaler for 16-mixed, ``None`` for bf16-mixed.
        skip_nonfinite: bf16-mixed: skip steps whose gradients hold inf/nan.
        warn_skip_streak: warn (``AmpPlusWarning``, rank zero) once this many updates in a row were skipped;
            ``None``: never.
        sharded: bf16-mixed: each rank holds a shard of the gradients, so the inf/nan flag is reduced over the
            ranks (16-mixed: pass a :class:`ShardedDynamicLossScaler`).
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        scaler: Optional[DynamicLossScaler],
        skip_nonfinite: bool = True,
        warn_skip_streak: Optional[int] = 50,
        sharded: bool = False,
    ) -> None:
        self.precision = precision
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        #: what decides a skip: the scaler (16-mixed), a checker that never scales (bf16-mixed), or nothing
        self.checker: Optional[DynamicLossScaler] = scaler
        #: which skips back the scale off: "any" (torch's rule) or "backward" (not one whose loss held inf/nan)
        self.backoff_on = "any"
        if scaler is None and skip_nonfinite:
            self.checker = NonFiniteChecker(sharded=sharded)
        #: warn once a run of this many skipped updates in a row is seen (None: never)
        self.warn_skip_streak = warn_skip_streak
        self.sharded = sharded
        self._given_state: Optional[dict[str, Any]] = None  # a user's scaler: its state as given (see use_scaler)
        self._listeners: list[UpdateListener] = []
        self._route()
        self._new_run()  # the scaler given is as its constructor made it

    def use_scaler(self, scaler: DynamicLossScaler) -> None:
        """Use the user's ``scaler`` from now on (16-mixed; checked by :func:`take_scaler`): its methods are called.

        A new run starts from its state as it was given (a used or loaded scaler goes on as stock Lightning's
        would), not from its constructor's.
        """
        self.scaler = self.checker = scaler
        self._given_state = scaler.state_dict()

    # ------------------------------------------------------------------ listeners
    def listen(self, listener: UpdateListener, first: bool = False) -> None:
        """Tell ``listener`` of the updates from now on (once, however often it is given; what it needs read again).

        ``first``: before those listening already (the plugin's own part, before a callback that may raise).
        """
        if listener not in self._listeners:
            self._listeners.insert(0, listener) if first else self._listeners.append(listener)
        self._route()

    def unlisten(self, listener: UpdateListener) -> None:
        """Stop telling ``listener``."""
        if listener in self._listeners:
            self._listeners.remove(listener)
            self._route()

    def clear_listeners(self) -> None:
        """Stop telling anyone (a fit's end: the next fit's parts listen afresh)."""
        self._listeners = []
        self._route()

    @property
    def listeners(self) -> tuple[UpdateListener, ...]:
        """Who listens."""
        return tuple(self._listeners)

    def _route(self) -> None:
        """Each hook's callers, from who listens and what each overrides (no call for a hook nobody needs)."""
        listening = self.listeners
        #: the plugin calls each just before a training step
        self.step_starting = [p.step_starting for p in listening if _overrides(p, "step_starting")]
        self._before_unscale = [p.before_unscale for p in listening if _overrides(p, "before_unscale")]
        self._skipped_step = [p.skipped_step for p in listening if _overrides(p, "skipped_step")]
        self._update_skipped = [p.update_skipped for p in listening if _overrides(p, "update_skipped")]
        #: a skip decided on the device (fused optimizers) is read on the host each step (one sync): someone needs it
        self.sync_skips = any(p.needs_host_skips for p in listening)

    def reset(self) -> None:
        """Start a new run: the scaler back to its constructor's state (a user's: as given), an empty history, no cycle.

        Listeners stay (callbacks attach before the run starts). A resumed run then loads its checkpoint on top.
        """
        if self.checker is not None:
            self.checker.reset()
            if self._given_state is not None:
                self.checker.load_state_dict(self._given_state)
        self._new_run()

    def _new_run(self) -> None:
        """The engine's own per-run state, fresh."""
        self.history = ScaleHistory(scaled=self.scaler is not None)
        self._cycle: Optional[UpdateCycle] = None
        #: the update that closed last (none yet: not skipped, nothing left over)
        self.closed = UpdateCycle(-1)
        self._streak_warned = False
        self._optimizers: list[Optimizer] = []  # every optimizer known to this run (for pending gradients)
        self._backwards = 0  # backward calls so far
        self._stepped_at: dict[int, int] = {}  # per optimizer: `_backwards` when it last stepped
        self._unscaled_at: dict[int, int] = {}  # per optimizer: `_backwards` when its gradients were last unscaled
        self._recorded_since_load = False  # the history's last scale is this scaler's (not a checkpoint's)
        self._last_record: Any = None  # the scaler's record of the last update this engine closed

    def register(self, optimizers: list[Any]) -> None:
        """Make ``optimizers`` known, so their pending gradients follow a change of scale (see :meth:`end_cycle`)."""
        for optimizer in optimizers:
            self._know(resolve_optimizer(optimizer))

    def _know(self, optimizer: Optimizer) -> None:
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)

    # ------------------------------------------------------------------ the cycle
    def scale(self, loss: Tensor) -> Tensor:
        """The loss times the current scale (unchanged for bf16-mixed); called once per backward."""
        # a backward onto unscaled gradients that never stepped: forget their unscale, and warn if they are kept
        cycle = self._cycle
        forgotten = self.forget_unstepped() if cycle is not None and cycle.unscaled else []
        stale: list[Optimizer] = []
        leftover = self.closed.leftover
        if leftover or forgotten:
            if self.checker is not None and leftover:
                self.checker.reset_cycle(leftover)
            stale = [o for o in [*leftover, *forgotten] if _has_gradients(o)]
            self.closed.leftover = []
        if stale:
            warn_unstepped(
                len(stale),
                "before this backward",
                "Their unscale was undone so that the next step unscales everything it applies; the gradients"
                " unscaled earlier are now divided by the scale twice.",
            )
        self._backwards += 1
        if self.backoff_on == "backward" and isinstance(self.checker, DynamicLossScaler):
            self.checker.backoff_on = "backward"  # the scaler in use now (one set later too)
            self.checker.note_loss(loss)
        return self.checker.scale(loss) if self.checker is not None else loss

    def has_new_gradients(self, optimizer: Optimizer) -> bool:
        """Whether a backward ran since ``optimizer`` last stepped (else its gradients hold nothing to unscale)."""
        return self._backwards > self._stepped_at.get(id(optimizer), 0)

    @property
    def cycle(self) -> Optional[UpdateCycle]:
        """The open update, or ``None``."""
        return self._cycle

    @property
    def cycle_open(self) -> bool:
        """Whether an update is open: some optimizer unscaled or stepped and the scale not yet updated."""
        return self._cycle is not None

    def begin(self, optimizer: Optimizer, step: Optional[int] = None) -> UpdateCycle:
        """Open an update (or join the open one) for ``optimizer``; ``step`` is the caller's step index."""
        if self._cycle is not None and optimizer in self._cycle.stepped:
            self.end_cycle()  # the same optimizer steps twice before the update closed: close it first
        cycle = self._cycle
        if cycle is None:
            last = self.history.last_step
            following = 0 if last is None else last + 1
            cycle = self._cycle = UpdateCycle(following if step is None else max(step, following))
            if self.checker is not None:
                self.checker.forget_skips()
                # still unscaled from an update whose step raised, no backward since: a retry applies them once
                leftover = self.closed.leftover
                if leftover:
                    carried = [o for o in leftover if self.checker.is_unscaled(o)]
                    cycle.unscaled.extend(carried)
                    self.closed.leftover = [o for o in leftover if o not in carried]
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return cycle

    def unscale(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients once per update (bf16: check them for inf/nan once)."""
        cycle = self._cycle if self._cycle is not None else self.begin(optimizer)
        if optimizer in cycle.unscaled:
            return
        cycle.unscaled.append(optimizer)
        self._unscaled_at[id(optimizer)] = self._backwards
        if self.checker is None:
            return
        if self.scaler is not None:
            for before_unscale in self._before_unscale:
                before_unscale(optimizer, cycle.step)
        self.checker.unscale_(optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/nan (parameters and state then stay bit-identical).

        A closure (``closure=``, LBFGS) is evaluated inside the step and checked after each evaluation (bf16-mixed).
        A step that raises is not counted and the exception propagates. Gradients it had already unscaled stay
        unscaled: a retry applies them once; a backward before the retry makes new gradients, unscaled anew.
        """
        cycle = self._cycle if self._cycle is not None else self.begin(optimizer)
        cycle.stepped.append(optimizer)
        try:
            if self.checker is None:
                return optimizer.step(**kwargs)
            result = self.checker.step(optimizer, **kwargs)
        except BaseException:
            cycle.stepped.remove(optimizer)
            if self.checker is not None and self.checker.is_unscaled(optimizer):
                # divided before the failure: a retry must not divide them again
                if optimizer not in cycle.unscaled:
                    cycle.unscaled.append(optimizer)
            else:
                self._forget(optimizer)
            raise
        finally:
            self._stepped_at[id(optimizer)] = self._backwards  # a closure's backward is part of this step
        if (
            self._skipped_step
            and self.checker is not None
            and self.checker.step_was_skipped(optimizer, sync=self.sync_skips)
        ):
            for skipped_step in self._skipped_step:
                skipped_step(optimizer)
        return result

    def _forget(self, optimizer: Optimizer) -> None:
        """Forget ``optimizer``'s unscale (and step outcome) in the open cycle: its next step unscales again."""
        if self._cycle is not None and optimizer in self._cycle.unscaled:
            self._cycle.unscaled.remove(optimizer)
        if self.checker is not None:
            self.checker.reset_cycle([optimizer])

    def forget_unstepped(self) -> list[Optimizer]:
        """Forget the unscale of optimizers that did not step in the open cycle (their next step unscales again)."""
        cycle = self._cycle
        if cycle is None:
            return []
        stale = cycle.unscaled_not_stepped()
        for optimizer in stale:
            self._forget(optimizer)
        if not cycle.stepped:
            self._cycle = None
        return stale

    def abort_cycle(self) -> None:
        """Close the open cycle after an exception, never raising over it.

        Steps that did run are recorded and update the scale as usual. Optimizers unscaled but not stepped (the one
        whose step raised, say) stay unscaled until the next backward, which forgets the unscale (their next step
        then unscales again): a retry without a backward applies the gradients once. A no-op when no cycle is open.
        """
        try:
            self.end_cycle()
        except Exception:  # the exception being handled is the one that matters
            if self.checker is not None:
                self.checker.reset_cycle()  # no known state left: the next step unscales what it applies
            self.closed.leftover = []
        finally:
            self._cycle = None

    def apply_pending_update(self) -> None:
        """Close the open cycle, if any optimizer stepped in it."""
        if self._cycle is not None and self._cycle.stepped:
            self.end_cycle()

    def end_cycle(self) -> None:
        """Record the update in the history, update the scale once, and tell the listeners about a known skip.

        Gradients still pending for an optimizer that did not step in this update (it accumulates over several
        batches while another steps) were scaled by the old scale: they are brought to the new one, so its next
        step unscales every part of them exactly.
        """
        cycle, self._cycle = self._cycle, None  # dropped whole, whatever happens below
        if cycle is None:
            return
        # unscaled but not stepped: a retry applies them once, the next backward forgets their unscale
        cycle.leftover = cycle.unscaled_not_stepped() if cycle.unscaled != cycle.stepped else []
        cycle.skipped, self.closed = self.closed.skipped, cycle  # a cycle without a step keeps the last outcome
        if not cycle.stepped:
            return
        checker = self.checker
        scale_before = 1.0
        if checker is None:
            self.history.record(cycle.step, 1.0, 0.0)
            skipped: Optional[bool] = False
        else:
            # gradients still scaled by the scale this update used, which no step consumed
            pending = self._pending_gradients() if self.scaler is not None else []
            # the history's last scale is this scaler's unless a checkpoint was loaded since: then it needs the scale,
            # which the update copies unless it is known to be the last one's (read here: `is True` for a mock too)
            unrecorded = not self._recorded_since_load and checker.scale_kept is True
            live = checker.scale_tensor() if pending or unrecorded else None
            before = live.clone() if live is not None else None
            if self.sync_skips:
                any_skipped(checker.outcomes(), sync=True)  # a fused step's flag read now: the update knows it
            checker.update()
            outcome = checker.last_update()
            if outcome is None or outcome is self._last_record:
                raise RuntimeError(
                    f"`{type(checker).__name__}.update()` kept no record of the update: an override of `update` must"
                    " call `super().update()`."
                )
            self._last_record = outcome
            if outcome.unstepped and any(id(o) in outcome.unstepped for o in cycle.stepped):
                raise RuntimeError(
                    f"`{type(checker).__name__}.step()` returned without stepping the optimizer: the update cannot be"
                    " told applied or skipped (the history, the scheduler and the scale would count it applied)."
                    " HINT: an override of `step` calls `super().step(optimizer)`, which skips an overflowed step"
                    " itself; to skip a batch on purpose, return None from `training_step`."
                )
            scale = before if unrecorded else outcome.scale
            self.history.record(cycle.step, scale, outcome.flag)  # None: the scale is the last one recorded
            self._recorded_since_load = True
            skipped = outcome.skipped
            if outcome.scale_before is not None and self.scaler is not None:
                scale_before = outcome.scale_before
            if pending and live is not None and before is not None:
                _multiply(pending, live / before)  # brought to the new scale: their next unscale is exact
        cycle.skipped = skipped
        if skipped is True:
            self.history.flush()  # the host knows already: the streak below is exact
        self._check_streak(skipped)
        if skipped is True and self._update_skipped:
            new_scale = self.scaler.get_scale() if self.scaler is not None else 1.0
            event = SkipEvent(
                step=cycle.step,
                scale=scale_before,
                new_scale=new_scale,
                optimizers=[o for o in cycle.stepped if self.step_was_skipped(o)],
                consecutive=self.history.trailing_skips,
            )
            for update_skipped in self._update_skipped:
                update_skipped(event)

    def _pending_gradients(self) -> list[Tensor]:
        """Gradients still scaled by the current scale: a backward ran after their optimizer last stepped or unscaled.

        That is an optimizer accumulating while another steps, or one that steps twice in a batch (its second
        backward ran before this update closed).
        """
        grads: list[Tensor] = []
        backwards = self._backwards
        for optimizer in self._optimizers:
            key = id(optimizer)
            if max(self._stepped_at.get(key, 0), self._unscaled_at.get(key, 0)) >= backwards:
                continue
            grads.extend(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
        return grads

    def _check_streak(self, skipped: Optional[bool]) -> None:
        """Say once (rank zero) when a run of skipped updates reaches ``warn_skip_streak``.

        The count is the history's (:attr:`ScaleHistory.trailing_skips`); a skip a fused optimizer decided on the
        device is counted once the history is flushed.
        """
        streak = 0 if skipped is False else self.history.trailing_skips
        if streak == 0:
            self._streak_warned = False
            return
        limit = self.warn_skip_streak
        if limit is None or streak < limit or self._streak_warned:
            return
        self._streak_warned = True
        if global_rank() != 0:
            return
        scale = f", loss scale {number(self.scaler.get_scale())}" if self.scaler is not None else ""
        warn_at_user(
            f"{streak} optimizer updates in a row were skipped (inf/nan gradients){scale}: the weights have"
            " not changed since. HINT: check the loss and inputs for inf/nan, lower the learning rate, or add"
            " `NaNSkipReporter` to name the parameters and stop the run (`max_consecutive_skips`)."
        )

    # ------------------------------------------------------------------ public state
    def overflowed(self, optimizer: Optimizer) -> Optional[bool]:
        """Whether ``optimizer``'s step in the open update will be skipped; None where the host cannot know it free.

        See :meth:`DynamicLossScaler.overflowed`.
        """
        return None if self.checker is None else self.checker.overflowed(optimizer)

    def step_was_skipped(self, optimizer: Optimizer, *, sync: bool = True) -> Optional[bool]:
        """Whether ``optimizer``'s last step was skipped (``None`` if it has not stepped).

        Free when the host already knows; for fused optimizers the flag is read from the device when ``sync``.
        """
        if self.checker is None:
            return False if id(optimizer) in self._stepped_at else None
        return self.checker.step_was_skipped(optimizer, sync=sync)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last cycle was skipped (reads the device flag for fused optimizers: one sync)."""
        closed = self.closed
        if closed.skipped is None and self.checker is not None:
            record = self._last_record  # the update's own record decides, its flag read now
            closed.skipped = record.read() if record is not None else any_skipped(self.checker.outcomes(), sync=True)
        return bool(closed.skipped)

    @property
    def skip_known_on_host(self) -> bool:
        """Whether the host already knows if the last cycle was skipped (False: a fused optimizer decided it)."""
        return self.closed.skipped is not None

    @property
    def applied_steps(self) -> int:
        """Updates that changed the weights (recorded updates minus skipped ones)."""
        return self.history.num_steps - self.history.num_skipped

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 for bf16-mixed). Reads the device value: one host sync."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the precision and the history; closes an open cycle first.

        The scaler's keys sit at the top level, as in stock ``MixedPrecision``'s state, so stock loads it too.
        """
        self.apply_pending_update()
        state: dict[str, Any] = {}
        if self.scaler is not None:
            state.update(self.scaler.state_dict())
        state.update(precision=self.precision, history=self.history.state_dict())
        return state

    def load_state_dict(self, state_dict: Any, where: str = "AmpEngine.load_state_dict") -> None:
        """Load :meth:`state_dict` output, a stock ``MixedPrecision``/``GradScaler`` state, or a 0.1.0 state.

        Every value is checked (errors name ``where``, the key and the value). A state of the other precision is
        converted, and says so: 16-mixed -> bf16-mixed drops the scaler state; bf16-mixed -> 16-mixed starts the
        scale at ``init_scale``; the history continues in both cases.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"`{where}` is invalid: expected a dict (the plugin's `state_dict()`), got"
                f" {type(state_dict).__name__}: {state_dict!r:.80}."
            )
        scaler_state = state_dict.get("scaler", state_dict)  # 0.1.0 nested the scaler's state
        has_scaler_state = isinstance(scaler_state, dict) and "scale" in scaler_state
        saved = state_dict.get("precision", "16-mixed" if has_scaler_state else None)
        if saved not in (None, "16-mixed", "bf16-mixed"):
            raise ValueError(f"`{where}['precision']={saved!r}` is invalid: expected '16-mixed' or 'bf16-mixed'.")
        if saved == "16-mixed" and not has_scaler_state:
            raise ValueError(
                f"`{where}` is invalid: a 16-mixed state needs the scaler's keys ('scale', 'growth_factor',"
                f" 'backoff_factor', 'growth_interval', '_growth_tracker'); it has {sorted(state_dict)}."
            )
        if "history" in state_dict:  # checked in full before anything is replaced
            ScaleHistory().load_state_dict(state_dict["history"], where=f"{where}['history']")
        if self.scaler is not None and has_scaler_state:
            self.scaler.load_state_dict(scaler_state)  # checks every value before it replaces any
        if "history" in state_dict:
            self.history.load_state_dict(state_dict["history"])
            self.history.scaled = self.scaler is not None  # this run's precision decides what the history shows
        self._recorded_since_load = False  # the next record writes the scale itself
        if saved is not None and saved != self.precision:
            if self.scaler is None:
                what = f"its loss scaler's state (scale {scaler_state.get('scale')!r}) is dropped"
            else:
                what = f"the loss scale starts at init_scale={number(self.scaler.get_scale())}"
            say(
                f"`{where}`: resuming a {saved} state under {self.precision}: {what}; the scale history continues"
                " (its curve shows the switch)."
            )


def warn_unstepped(count: int, when: str, consequence: str) -> None:
    """The one warning for gradients unscaled (clipped) whose optimizer then did not step."""
    warn_at_user(
        f"{count} optimizer(s) had their gradients unscaled (by `clip_gradients` or `unscale_`) {when} but did not"
        f" step. {consequence} HINT: unscale or clip only right before `optimizer.step()`."
    )


def _multiply(tensors: list[Tensor], factor: Tensor) -> None:
    """``t *= factor`` for every tensor, one foreach kernel per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))


def _has_gradients(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


#: the scaler knobs' defaults (declared once, in :mod:`lightning_amp_plus.knobs`)
SCALER_DEFAULTS = DEFAULTS


def refuse_closure_optimizer(owner: str, optimizer: Optimizer) -> None:
    """16-mixed cannot step an optimizer that re-evaluates its closure inside ``step()`` (LBFGS): say so, once."""
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            f"`{owner}(precision='16-mixed')` cannot train with `torch.optim.LBFGS`: LBFGS re-evaluates the closure"
            " inside `step()`, which loss scaling breaks. HINT: use precision='bf16-mixed' or 32-bit precision with"
            " LBFGS."
        )


def _precision_hint(precision: Any) -> str:
    """What a refused ``precision`` most likely meant: a mixed precision, named as Lightning names it."""
    word = str(precision).lower().replace("_", "-")
    if word in ("16-true", "bf16-true"):
        return f"this plugin is mixed precision: for pure half precision leave it out (`Trainer(precision='{word}')`)."
    if "bf16" in word or "bfloat16" in word:
        return "use precision='bf16-mixed' (bfloat16 autocast, float32 weights)."
    if word in ("16", "fp16", "float16", "half", "16-mixed", "mixed") or word.startswith(("16", "fp16")):
        return "use precision='16-mixed' (float16 autocast with loss scaling, float32 weights)."
    return "for fp32 leave the plugin out; for pure half precision use Lightning's `precision='16-true'`."


def make_engine(
    owner: str,
    precision: Any,
    device: Any,
    skip_nonfinite: Any,
    knobs: dict[str, Any],
    warn_skip_streak: Any,
    sharded: bool = False,
    scaler: Any = None,
) -> AmpEngine:
    """Validate a plugin's arguments (messages name ``owner``) and build its engine.

    ``sharded``: each rank holds a shard of the gradients (FSDP): the skip flag is reduced over the ranks, in both
    precisions. ``scaler``: the user's own (see :func:`take_scaler`); the knobs then are its own.
    """
    check_choice(owner, "precision", precision, ("16-mixed", "bf16-mixed"), hint=_precision_hint(precision))
    check_device(owner, device)
    check_bool(owner, "skip_nonfinite", skip_nonfinite)
    if warn_skip_streak is not None:
        check_int(owner, "warn_skip_streak", warn_skip_streak, minimum=1)
    given = {k: v for k, v in knobs.items() if not same_value(v, SCALER_DEFAULTS[k])}  # bf16 refuses a changed knob
    if precision == "bf16-mixed" and given:
        names = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"`{owner}(precision='bf16-mixed', {names})` is invalid: bf16-mixed uses no loss scaler."
            " HINT: remove the scaler arguments, or use precision='16-mixed'."
        )
    given_scaler = scaler
    if scaler is not None:
        if given:
            names = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(
                f"`{owner}(scaler=..., {names})` is invalid: the scaler given holds its own knobs. HINT: set them on"
                " the scaler, or leave `scaler=` out."
            )
        scaler = take_scaler(owner, scaler, precision, sharded)
    elif precision == "16-mixed":
        check_knobs(owner, {**SCALER_DEFAULTS, **given})
        # the device type may only be known later (`device=None`); "cpu" never disables the scaler meanwhile
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"`{owner}(device='cuda')` is invalid: CUDA is not available here. HINT: leave `device=None` to"
                " follow the trainer's accelerator."
            )
        scaler_class = ShardedDynamicLossScaler if sharded else DynamicLossScaler
        scaler = scaler_class(device or "cpu", **{**SCALER_DEFAULTS, **given})
        scaler.keep_given = True  # the plugin's knobs: one given on resume is meant (the checkpoint's scale wins)
    if precision == "16-mixed" and not skip_nonfinite:
        raise ValueError(
            f"`{owner}(precision='16-mixed', skip_nonfinite=False)` is invalid: with loss scaling an overflowing"
            " step must be skipped. `skip_nonfinite` applies to bf16-mixed only."
        )
    engine = AmpEngine(precision, scaler, skip_nonfinite, warn_skip_streak, sharded=sharded)
    if given_scaler is not None and scaler is not None:
        engine.use_scaler(scaler)
    return engine


def take_scaler(owner: str, scaler: Any, precision: str, sharded: bool) -> Any:
    """The loss scaler a plugin uses when given one (``scaler=``, or ``plugin.scaler = ...``), checked.

    A :class:`DynamicLossScaler` (a subclass included) is used as it is, and so is a ``unittest.mock`` object that
    wraps one (``Mock(wraps=plugin.scaler)``, as Lightning's tests do); a ``torch.amp.GradScaler`` (torch's
    ``ShardedGradScaler`` too) is taken as a :class:`DynamicLossScaler` with its knobs and state
    (:meth:`DynamicLossScaler.from_grad_scaler`). Anything else, a disabled scaler, a scaler under bf16-mixed, or an
    unsharded one under FSDP is an error naming the value.
    """
    if precision == "bf16-mixed":
        raise ValueError(
            f"`{owner}(precision='bf16-mixed', scaler={type(scaler).__name__}(...))` is invalid: bf16-mixed uses no"
            " loss scaler. HINT: leave `scaler=` out, or use precision='16-mixed'."
        )
    mocked = any(cls.__module__ == "unittest.mock" for cls in type(scaler).__mro__)  # by type: no import
    inner = getattr(scaler, "_mock_wraps", None) if mocked else scaler  # a spec alone passes isinstance: not enough
    wanted = ShardedDynamicLossScaler if sharded else DynamicLossScaler
    if isinstance(inner, torch.amp.GradScaler) and not inner.is_enabled():
        device = getattr(inner, "_device", "?")
        raise ValueError(
            f"`{owner}(scaler={type(inner).__name__}({device!r}, ...))` is invalid: the scaler is disabled"
            f" (`enabled=False`, or torch turned it off: no {device!r} device here), and a disabled scaler scales"
            " nothing (float16 gradients underflow, overflowing steps are not skipped). HINT: pass an enabled"
            " scaler for the trainer's device, or use bf16-mixed."
        )
    if isinstance(inner, DynamicLossScaler) and not isinstance(inner, NonFiniteChecker):
        if not isinstance(inner, wanted):
            raise TypeError(
                f"`{owner}(scaler={inner!r})` is invalid: each rank holds a shard of the gradients, so the overflow"
                " flag must be reduced over the ranks. HINT: use `ShardedDynamicLossScaler` with the same knobs."
            )
        return scaler
    if isinstance(inner, NonFiniteChecker):
        why = "a `NonFiniteChecker` never scales: it is bf16-mixed's check. HINT: use precision='bf16-mixed'"
    elif mocked:
        why = "a mock stands in for a scaler only when it wraps one. HINT: `Mock(wraps=plugin.scaler)`"
    elif isinstance(scaler, torch.amp.GradScaler) and type(scaler).__module__.partition(".")[0] == "torch":
        extra = {"process_group": scaler.process_group} if sharded and hasattr(scaler, "process_group") else {}
        return wanted.from_grad_scaler(scaler, **extra)
    elif isinstance(scaler, torch.amp.GradScaler):
        why = (
            "its own methods would not run (a torch GradScaler is taken by its knobs and state)."
            " HINT: subclass `DynamicLossScaler` instead"
        )
    else:
        why = "expected a `DynamicLossScaler` (a subclass included) or a `torch.amp.GradScaler`"
    raise TypeError(f"`{owner}(scaler={type(scaler).__name__}(...))` is invalid: {why}.")


class EngineView:
    """The public state of a plugin's :class:`AmpEngine` (``self._engine``): shared by both plugins."""

    _engine: AmpEngine
    _given: dict[str, Any]

    # 0.2's names, deprecated (lightning_amp_plus._compat)
    skip_listeners = Deprecated(
        "skip",
        "plugin.listen(listener), a listener overriding `update_skipped(event)`",
        "Deprecated: callables ``(event)`` run on each skipped update the host knows (0.2).",
    )
    before_unscale_listeners = Deprecated(
        "unscale",
        "plugin.listen(listener), a listener overriding `before_unscale(optimizer, step)`",
        "Deprecated: callables ``(optimizer, step)`` run just before an optimizer's gradients are unscaled (0.2).",
    )
    sync_skips = Deprecated(
        "needs_host_skips",
        "a listener with `needs_host_skips = True` (the read follows who listens)",
        "Deprecated: whether a fused optimizer's skip is read on the host at each step (one sync a step).",
    )

    @property
    def engine(self) -> AmpEngine:
        """The shared scale/unscale/step/skip/record/update engine."""
        return self._engine

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        """The loss scaler (16-mixed), or ``None`` (bf16-mixed).

        Settable, as stock ``MixedPrecision.scaler`` is (checked as ``scaler=`` is): the plugin calls its public
        ``scale``, ``unscale_``, ``step`` and ``update``, so a subclass or a mock wrapping it sees every call.
        """
        return self._engine.scaler

    @scaler.setter
    def scaler(self, value: Any) -> None:
        engine = self._engine
        if value is None and engine.precision == "bf16-mixed":
            return
        if value is None:
            raise ValueError(
                f"`{type(self).__name__}.scaler = None` is invalid: 16-mixed needs a loss scaler. HINT: use"
                " precision='bf16-mixed' for mixed precision without one."
            )
        engine.use_scaler(take_scaler(type(self).__name__, value, engine.precision, engine.sharded))
        # the plugin's call, as repr, the logged call and fix lines tell it: this scaler in place of the knobs
        given = {k: v for k, v in getattr(self, "_given", {}).items() if k not in SCALER_DEFAULTS}
        self._given = {**given, "scaler": engine.scaler}  # the scaler in use (a GradScaler given: the one taken)

    @property
    def history(self) -> ScaleHistory:
        """The scale curve and the skipped steps."""
        return self._engine.history

    def listen(self, listener: UpdateListener) -> None:
        """Tell ``listener`` (an :class:`UpdateListener`) of the updates; the plugin forgets it at its teardown."""
        self._engine.listen(listener)

    def unlisten(self, listener: UpdateListener) -> None:
        """Stop telling ``listener``."""
        self._engine.unlisten(listener)

    @property
    def listeners(self) -> tuple[UpdateListener, ...]:
        """Who listens to the updates."""
        return self._engine.listeners

    def step_was_skipped(self, optimizer: Optimizer, *, sync: bool = True) -> Optional[bool]:
        """Whether ``optimizer``'s last step was skipped (``None`` if it has not stepped)."""
        return self._engine.step_was_skipped(resolve_optimizer(optimizer), sync=sync)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer-step cycle was skipped (reads the device flag for fused optimizers)."""
        return self._engine.optimizer_step_was_skipped

    @property
    def skip_known_on_host(self) -> bool:
        """Whether the host already knows if the last cycle was skipped (False: a fused optimizer decided it)."""
        return self._engine.closed.skipped is not None  # read directly: every callback asks each step

    @property
    def applied_steps(self) -> int:
        """Updates that changed the weights (``trainer.global_step`` counts skipped ones, and every optimizer's)."""
        return self._engine.applied_steps

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 for bf16-mixed). Reads the device value: one host sync."""
        return self._engine.loss_scale
