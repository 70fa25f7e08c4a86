"""AmpEngine: the optimizer-step cycle shared by the Lightning and Fabric plugins (torch only).

One cycle: ``begin`` -> ``unscale`` (once per optimizer) -> the caller's hooks and clipping -> ``step`` (or skip)
-> ``end_cycle`` (record in the history, update the scale once, tell the listeners). A cycle may hold several
optimizers (one backward, two optimizers; a GAN's two steps in one batch): the scale updates once, at its end.

Every method that takes an optimizer resolves wrappers (``LightningOptimizer``, Fabric's optimizer) to the optimizer
inside first, so a wrapper and its optimizer are one identity. An exception inside the cycle (``abort_cycle``) or a
new backward onto gradients that were unscaled but not stepped never leaves a stale "unscaled" mark behind: the next
step always unscales what it applies.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_amp_plus._log import say
from lightning_amp_plus._validation import check_bool, check_choice, check_device, check_int, check_scaler_args
from lightning_amp_plus._warnings import AmpPlusWarning
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.scaler import DynamicLossScaler, unwrap_optimizer


@dataclass
class SkipEvent:
    """A skipped optimizer-step cycle, as handed to the ``skip_listeners``.

    Gradients are still in place (unscaled) when listeners run, so they can be inspected.
    """

    step: int
    scale: float
    new_scale: float
    optimizers: list[Optimizer] = field(default_factory=list)


class AmpEngine:
    """The scale/unscale/step/skip/record/update cycle, independent of any trainer.

    Args:
        precision: ``"16-mixed"`` (uses ``scaler``) or ``"bf16-mixed"`` (no scaler).
        scaler: the loss scaler for 16-mixed, ``None`` for bf16-mixed.
        skip_nonfinite: bf16-mixed: skip steps whose gradients hold inf/nan.
        warn_skip_streak: warn (``AmpPlusWarning``) once this many cycles in a row were skipped; ``None``: never.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        scaler: Optional[DynamicLossScaler],
        skip_nonfinite: bool = True,
        warn_skip_streak: Optional[int] = 50,
    ) -> None:
        self.precision = precision
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        #: warn once a run of this many skipped cycles in a row is seen (None: never)
        self.warn_skip_streak = warn_skip_streak
        self._streak = 0
        self._streak_warned = False
        self.history = ScaleHistory()
        #: callables run on every skipped cycle whose skip the host knows (see :class:`SkipEvent`)
        self.skip_listeners: list[Callable[[SkipEvent], None]] = []
        #: callables ``(optimizer, step)`` run just before an optimizer's gradients are unscaled (16-mixed)
        self.before_unscale_listeners: list[Callable[[Optimizer, int], None]] = []
        #: when True, a skip decided on the device (fused optimizers) is read on the host each step (one sync)
        self.sync_skips = False
        self._cycle_step: Optional[int] = None
        self._cycle_optimizers: list[Optimizer] = []
        self._unscaled: list[Optimizer] = []
        self._bf16_found: dict[int, Tensor] = {}
        self._bf16_cycle_found: Optional[Tensor] = None
        self._bf16_skipped: dict[int, Union[bool, Tensor]] = {}
        self._last_cycle_skipped: Union[bool, Tensor, None] = None
        self._one: Optional[Tensor] = None
        self._backwards = 0  # backward calls so far
        self._stepped_at: dict[int, int] = {}  # per optimizer: `_backwards` when it last stepped

    # ------------------------------------------------------------------ the cycle
    def scale(self, loss: Tensor) -> Tensor:
        """The loss times the current scale (unchanged for bf16-mixed); called once per backward."""
        if self._unscaled:
            # gradients unscaled but never stepped: forget the unscale; warn unless they were zeroed since
            stale = [o for o in self.forget_unstepped() if _has_gradients(o)]
            if stale:
                warnings.warn(
                    f"{len(stale)} optimizer(s) had their gradients unscaled (e.g. by clipping) but did not step"
                    " before this backward. Their unscale was undone so that the next step unscales everything it"
                    " applies; the gradients unscaled earlier are now divided by the scale twice. HINT: unscale or"
                    " clip only right before `optimizer.step()`.",
                    AmpPlusWarning,
                    stacklevel=3,
                )
        self._backwards += 1
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def has_new_gradients(self, optimizer: Optimizer) -> bool:
        """Whether a backward ran since ``optimizer`` last stepped (else its gradients hold nothing to unscale)."""
        return self._backwards > self._stepped_at.get(id(unwrap_optimizer(optimizer)), 0)

    @property
    def cycle_open(self) -> bool:
        """Whether a cycle is open: some optimizer unscaled or stepped and the scale not yet updated."""
        return bool(self._unscaled or self._cycle_optimizers) or self._cycle_step is not None

    def next_step(self) -> int:
        """The step index the next cycle gets when the caller has none: one past the last recorded."""
        last = self.history.last_step
        return 0 if last is None else last + 1

    def begin(self, optimizer: Optimizer, step: Optional[int] = None) -> None:
        """Open a cycle (or join the open one) for ``optimizer``; ``step`` is the caller's step index."""
        optimizer = unwrap_optimizer(optimizer)
        if any(o is optimizer for o in self._cycle_optimizers):
            self.end_cycle()  # the same optimizer steps twice before the cycle closed: close it first
        if self._cycle_step is None:
            self._cycle_step = self.next_step() if step is None else max(step, self.next_step())
            self._bf16_skipped.clear()
            if self.scaler is not None:
                self.scaler.forget_skips()

    def unscale(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients once per cycle (bf16: find non-finite gradients once)."""
        optimizer = unwrap_optimizer(optimizer)
        if not any(o is optimizer for o in self._unscaled):
            self._unscaled.append(optimizer)
        if self.scaler is not None:
            if not self.scaler.is_unscaled(optimizer):
                step = self._cycle_step if self._cycle_step is not None else self.next_step()
                for listener in list(self.before_unscale_listeners):
                    listener(optimizer, step)
                self.scaler.unscale_(optimizer)
        elif self.skip_nonfinite and id(optimizer) not in self._bf16_found:
            self._bf16_found[id(optimizer)] = nonfinite_flag(optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/nan (parameters and state then stay bit-identical).

        A step that raises is not counted: the optimizer leaves the cycle (its unscale is forgotten) and the
        exception propagates.
        """
        optimizer = unwrap_optimizer(optimizer)
        self._cycle_optimizers.append(optimizer)
        self._stepped_at[id(optimizer)] = self._backwards
        try:
            return self._step(optimizer, **kwargs)
        except BaseException:
            self._cycle_optimizers = [o for o in self._cycle_optimizers if o is not optimizer]
            self._forget(optimizer)
            raise

    def _step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self.scaler is not None:
            return self.scaler.step(optimizer, **kwargs)
        found = self._bf16_found.pop(id(optimizer), None)
        if found is None:
            return optimizer.step(**kwargs)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # fused kernels skip on the device: no host sync
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                output = optimizer.step(**kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            self._bf16_skipped[id(optimizer)] = found  # read only if someone asks
        else:
            skipped = bool(found.item())
            self._bf16_skipped[id(optimizer)] = skipped
            output = None if skipped else optimizer.step(**kwargs)
        self._bf16_cycle_found = found if self._bf16_cycle_found is None else self._bf16_cycle_found + found
        return output

    def _forget(self, optimizer: Optimizer) -> None:
        """Forget ``optimizer``'s unscale (and step outcome) in the open cycle: its next step unscales again."""
        self._unscaled = [o for o in self._unscaled if o is not optimizer]
        self._bf16_found.pop(id(optimizer), None)
        self._bf16_skipped.pop(id(optimizer), None)
        if self.scaler is not None:
            self.scaler.reset_cycle([optimizer])

    def forget_unstepped(self) -> list[Optimizer]:
        """Forget the unscale of optimizers that did not step in the open cycle (their next step unscales again)."""
        stale = self.unscaled_not_stepped()
        for optimizer in stale:
            self._forget(optimizer)
        if not self._cycle_optimizers:
            self._cycle_step = None
        return stale

    def abort_cycle(self) -> None:
        """Close the open cycle after an exception, never raising over it.

        Steps that did run are recorded and update the scale as usual; optimizers unscaled but not stepped are
        forgotten (their next step unscales again). A no-op when no cycle is open.
        """
        try:
            if self._cycle_optimizers:
                self.end_cycle()
        except Exception:  # noqa: S110 - the exception being handled is the one that matters
            pass
        finally:  # forget every unscale of the cycle: the next step unscales what it applies
            if self.scaler is not None:
                self.scaler.reset_cycle()
            self._cycle_optimizers = []
            self._unscaled = []
            self._cycle_step = None
            self._bf16_found.clear()
            self._bf16_cycle_found = None

    def unscaled_not_stepped(self) -> list[Optimizer]:
        """Optimizers unscaled (e.g. clipped) in the open cycle that have not stepped."""
        if not self._unscaled:
            return []
        return [o for o in self._unscaled if not any(o is s for s in self._cycle_optimizers)]

    def apply_pending_update(self) -> None:
        """Close the open cycle, if any."""
        if self._cycle_optimizers:
            self.end_cycle()

    def end_cycle(self) -> None:
        """Record the cycle in the history, update the scale once, and tell the listeners about a known skip."""
        step = self._cycle_step if self._cycle_step is not None else self.next_step()
        optimizers = self._cycle_optimizers
        scale_before = 1.0
        if self.scaler is not None:
            scale = self.scaler.scale_tensor()
            assert scale is not None
            self.history.record(step, scale, self.scaler.found_inf())
            skipped = self._cycle_skipped(optimizers)
            if skipped is True:
                scale_before = float(scale.item())  # only on skipped steps
            self.scaler.update()
        else:
            found, self._bf16_cycle_found = self._bf16_cycle_found, None
            if found is None:
                self.history.record(step, 1.0, 0.0)
            else:
                if self._one is None or self._one.device != found.device:
                    self._one = torch.ones((), device=found.device)
                self.history.record(step, self._one, found)
            skipped = self._cycle_skipped(optimizers)
        self._last_cycle_skipped = skipped
        self._cycle_optimizers = []
        self._unscaled = []
        self._cycle_step = None
        if skipped is True and self.skip_listeners:
            new_scale = self.scaler.get_scale() if self.scaler is not None else 1.0
            event = SkipEvent(
                step=step,
                scale=scale_before,
                new_scale=new_scale,
                optimizers=[o for o in optimizers if self.step_was_skipped(o)],
            )
            for listener in list(self.skip_listeners):
                listener(event)
        self._check_streak(skipped)

    def _check_streak(self, skipped: Optional[bool]) -> None:
        """Say once when a run of skipped cycles passes ``warn_skip_streak`` (known on the host, or at a flush)."""
        if skipped is None:  # decided on the device (fused): what the history has flushed so far
            self._streak = self.history.trailing_skips
        else:
            self._streak = self._streak + 1 if skipped else 0
        if self._streak == 0:
            self._streak_warned = False
        elif self.warn_skip_streak is not None and self._streak >= self.warn_skip_streak and not self._streak_warned:
            self._streak_warned = True
            scale = f", loss scale {self.scaler.get_scale():g}" if self.scaler is not None else ""
            warnings.warn(
                f"{self._streak} optimizer updates in a row were skipped (inf/nan gradients){scale}: the weights have"
                " not changed since. HINT: check the loss and inputs for inf/nan, lower the learning rate, or add"
                " `NaNSkipReporter` to name the parameters and stop the run (`max_consecutive_skips`).",
                AmpPlusWarning,
                stacklevel=2,
            )

    def _cycle_skipped(self, optimizers: list[Optimizer]) -> Optional[bool]:
        """Whether some optimizer of the cycle skipped: known on the host, or None (decided on the device)."""
        outcome: Optional[bool] = False
        for optimizer in optimizers:
            skipped = self.step_was_skipped(optimizer, sync=self.sync_skips)
            if skipped is True:
                return True
            if skipped is None:
                outcome = None
        return outcome

    # ------------------------------------------------------------------ public state
    def step_was_skipped(self, optimizer: Optimizer, *, sync: bool = True) -> Optional[bool]:
        """Whether ``optimizer``'s last step was skipped (``None`` if it has not stepped).

        Free when the host already knows; for fused optimizers the flag is read from the device when ``sync``.
        """
        optimizer = unwrap_optimizer(optimizer)
        if self.scaler is not None:
            return self.scaler.step_was_skipped(optimizer, sync=sync)
        value = self._bf16_skipped.get(id(optimizer))
        if value is None or isinstance(value, bool):
            return value
        if not sync:
            return None
        resolved = bool(value.item())
        self._bf16_skipped[id(optimizer)] = resolved
        return resolved

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last cycle was skipped (reads the device flag for fused optimizers: one sync)."""
        if self._last_cycle_skipped is None:
            if self.scaler is not None:
                self._last_cycle_skipped = self.scaler.any_step_skipped()
            else:
                flags = [bool(f.item()) if isinstance(f, Tensor) else f for f in self._bf16_skipped.values()]
                self._last_cycle_skipped = any(flags)
        return bool(self._last_cycle_skipped)

    @property
    def skip_known_on_host(self) -> bool:
        """Whether the host already knows if the last cycle was skipped (False: a fused optimizer decided it)."""
        return self._last_cycle_skipped is not None

    @property
    def applied_steps(self) -> int:
        """Cycles that updated the weights (recorded cycles minus skipped ones)."""
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
        if saved is not None and saved != self.precision:
            if self.scaler is None:
                what = f"its loss scaler's state (scale {scaler_state.get('scale')!r}) is dropped"
            else:
                what = f"the loss scale starts at init_scale={self.scaler.get_scale():g}"
            say(
                f"`{where}`: resuming a {saved} state under {self.precision}: {what}; the scale history continues"
                " (its curve shows the switch)."
            )


def _has_gradients(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def nonfinite_flag(optimizer: Optimizer) -> Tensor:
    """A device flag (> 0) telling whether any gradient of ``optimizer`` holds inf/nan; no host sync.

    Uses torch's fused AMP check with an inverse scale of exactly 1 (``x * 1.0 == x`` for every float, so the
    gradients are unchanged), as ``GradScaler`` does for fused optimizers: one kernel per device and dtype, about 10x
    faster on CPU than a foreach inf-norm.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grad = param.grad._values() if param.grad.is_sparse else param.grad
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
    if not groups:
        warnings.warn("an optimizer stepped without any gradient.", AmpPlusWarning, stacklevel=3)
        return torch.zeros(())
    found: Optional[Tensor] = None
    with torch.no_grad():
        for (device, _), grads in groups.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones((), device=device))
            found = flag if found is None else found + flag.to(found.device)
    assert found is not None
    return found


SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 1,
}


def make_engine(
    owner: str,
    precision: Any,
    device: Any,
    skip_nonfinite: Any,
    knobs: dict[str, Any],
    warn_skip_streak: Any = 50,
    scaler_class: type[DynamicLossScaler] = DynamicLossScaler,
) -> AmpEngine:
    """Validate a plugin's arguments (messages name ``owner``) and build its engine."""
    check_choice(
        owner,
        "precision",
        precision,
        ("16-mixed", "bf16-mixed"),
        hint="for fp32 leave the plugin out; for pure half precision use Lightning's `precision='16-true'`.",
    )
    check_device(owner, device)
    check_bool(owner, "skip_nonfinite", skip_nonfinite)
    if warn_skip_streak is not None:
        check_int(owner, "warn_skip_streak", warn_skip_streak, minimum=1)
    given = {k: v for k, v in knobs.items() if v is not None}
    if precision == "bf16-mixed" and given:
        names = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"`{owner}(precision='bf16-mixed', {names})` is invalid: bf16-mixed uses no loss scaler."
            " HINT: remove the scaler arguments, or use precision='16-mixed'."
        )
    scaler = None
    if precision == "16-mixed":
        check_scaler_args(owner, **{**SCALER_DEFAULTS, **given})
        if not skip_nonfinite:
            raise ValueError(
                f"`{owner}(precision='16-mixed', skip_nonfinite=False)` is invalid: with loss scaling an overflowing"
                " step must be skipped. `skip_nonfinite` applies to bf16-mixed only."
            )
        # the device type may only be known later (`device=None`); "cpu" never disables the scaler meanwhile
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"`{owner}(device='cuda')` is invalid: CUDA is not available here. HINT: leave `device=None` to"
                " follow the trainer's accelerator."
            )
        scaler = scaler_class(device or "cpu", **{**SCALER_DEFAULTS, **given})
    return AmpEngine(precision, scaler, skip_nonfinite, warn_skip_streak)


class EngineView:
    """The public state of a plugin's :class:`AmpEngine` (``self._engine``): shared by both plugins."""

    _engine: AmpEngine

    @property
    def engine(self) -> AmpEngine:
        """The shared scale/unscale/step/skip/record/update engine."""
        return self._engine

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        """The loss scaler (16-mixed), or ``None`` (bf16-mixed)."""
        return self._engine.scaler

    @property
    def history(self) -> ScaleHistory:
        """The scale curve and the skipped steps."""
        return self._engine.history

    @property
    def skip_listeners(self) -> list[Callable[[SkipEvent], None]]:
        """Callables run on every skipped step whose skip the host knows (see :class:`SkipEvent`)."""
        return self._engine.skip_listeners

    @property
    def before_unscale_listeners(self) -> list[Callable[[Optimizer, int], None]]:
        """Callables ``(optimizer, step)`` run just before an optimizer's gradients are unscaled (16-mixed)."""
        return self._engine.before_unscale_listeners

    @property
    def sync_skips(self) -> bool:
        """When True, a skip decided on the device (fused optimizers) is read on the host each step (one sync)."""
        return self._engine.sync_skips

    @sync_skips.setter
    def sync_skips(self, value: bool) -> None:
        self._engine.sync_skips = value

    def step_was_skipped(self, optimizer: Optimizer, *, sync: bool = True) -> Optional[bool]:
        """Whether ``optimizer``'s last step was skipped (``None`` if it has not stepped)."""
        return self._engine.step_was_skipped(optimizer, sync=sync)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer-step cycle was skipped (reads the device flag for fused optimizers)."""
        return self._engine.optimizer_step_was_skipped

    @property
    def skip_known_on_host(self) -> bool:
        """Whether the host already knows if the last cycle was skipped (False: a fused optimizer decided it)."""
        return self._engine.skip_known_on_host

    @property
    def applied_steps(self) -> int:
        """Optimizer-step cycles that updated the weights (``trainer.global_step`` counts skipped ones too)."""
        return self._engine.applied_steps

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 for bf16-mixed). Reads the device value: one host sync."""
        return self._engine.loss_scale
