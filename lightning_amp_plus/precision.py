"""AmpPlusPrecision: the Lightning precision plugin.

The flow a loss takes, top to bottom: autocast forward -> hooks see the true loss -> scale -> backward ->
unscale once per optimizer per cycle -> hooks and clipping see true gradients -> step (or skip) -> record in the
history -> update the scale once per cycle (after the batch's last optimizer step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_amp_plus._validation import check_bool, check_choice, check_scaler_args
from lightning_amp_plus.history import ScaleHistory
from lightning_amp_plus.islands import Fp32Islands, check_entries
from lightning_amp_plus.scaler import DynamicLossScaler

_SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 1,
}


@dataclass
class SkipEvent:
    """A skipped optimizer-step cycle, as handed to :attr:`AmpPlusPrecision.skip_listeners`.

    Gradients are still in place (unscaled) when listeners run, so they can be inspected.
    """

    step: int
    scale: float
    new_scale: float
    optimizers: list[Optimizer] = field(default_factory=list)


class AmpPlusPrecision(Precision):
    """Mixed precision with a bounded dynamic loss scaler, unscale-before-clip and skip bookkeeping.

    Args:
        precision: ``"16-mixed"`` (float16 autocast with loss scaling) or ``"bf16-mixed"`` (bfloat16, no scaling).
        device: device type for autocast and the scaler; ``None`` means the trainer's accelerator type.
        init_scale: initial loss scale (16-mixed; default ``2.0**16``).
        growth_factor: scale multiplier after ``growth_interval`` clean steps (default ``2.0``).
        backoff_factor: scale multiplier on overflow (default ``0.5``).
        growth_interval: clean steps in a row before the scale grows (default ``2000``).
        min_scale: lower bound of the scale (default ``1.0``).
        max_scale: upper bound of the scale (default ``2.0**24``).
        hysteresis: overflows tolerated before the scale backs off (default ``1``: back off on every overflow).
        skip_nonfinite: bf16-mixed only: skip optimizer steps whose gradients hold inf/nan (default ``True``).
            Costs one host sync per step with a non-fused optimizer. 16-mixed always skips.
        skip_scheduler_on_overflow: do not advance step-interval LR schedulers on skipped steps (default ``True``).
        fp32_modules: modules to run in float32 with autocast disabled ("fp32 islands"): module classes, their
            import paths (``"torch.nn.LayerNorm"``), or qualified names / glob patterns as in ``named_modules()``
            (``"head"``, ``"encoder.*.attn"``). Installed when the model is connected, removed at teardown;
            ``state_dict()`` keys never change. An entry that matches nothing is an error.

    The scaler knobs are for ``"16-mixed"``; giving one with ``"bf16-mixed"`` is an error.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_amp_plus import AmpPlusPrecision
        >>> plugin = AmpPlusPrecision("16-mixed", growth_interval=500)
        >>> plugin.scaler.get_growth_interval()
        500
        >>> trainer = Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
        >>> trainer.precision
        '16-mixed'
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: Optional[str] = None,
        *,
        init_scale: Optional[float] = None,
        growth_factor: Optional[float] = None,
        backoff_factor: Optional[float] = None,
        growth_interval: Optional[int] = None,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: Optional[int] = None,
        skip_nonfinite: bool = True,
        skip_scheduler_on_overflow: bool = True,
        fp32_modules: Optional[list[Union[str, type[torch.nn.Module]]]] = None,
    ) -> None:
        owner = type(self).__name__
        check_choice(
            owner,
            "precision",
            precision,
            ("16-mixed", "bf16-mixed"),
            hint="for fp32 leave the plugin out; for pure half precision use Lightning's `precision='16-true'`.",
        )
        if device is not None and not isinstance(device, str):
            raise TypeError(
                f"`{owner}(device={device!r})` is invalid: expected a device type string such as 'cuda' or 'cpu',"
                " or None for the trainer's accelerator."
            )
        check_bool(owner, "skip_nonfinite", skip_nonfinite)
        check_bool(owner, "skip_scheduler_on_overflow", skip_scheduler_on_overflow)
        knobs = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "hysteresis": hysteresis,
        }
        given = {k: v for k, v in knobs.items() if v is not None}
        if precision == "bf16-mixed" and given:
            names = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(
                f"`{owner}(precision='bf16-mixed', {names})` is invalid: bf16-mixed uses no loss scaler."
                " HINT: remove the scaler arguments, or use precision='16-mixed'."
            )
        if precision == "16-mixed":
            check_scaler_args(owner, **{**_SCALER_DEFAULTS, **given})
        if precision == "16-mixed" and not skip_nonfinite:
            raise ValueError(
                f"`{owner}(precision='16-mixed', skip_nonfinite=False)` is invalid: with loss scaling an overflowing"
                " step must be skipped. `skip_nonfinite` applies to bf16-mixed only."
            )
        self.precision: Literal["16-mixed", "bf16-mixed"] = precision
        self.device = device
        self.skip_nonfinite = skip_nonfinite
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.fp32_modules = check_entries(owner, fp32_modules)
        self._islands = Fp32Islands(self.fp32_modules)
        self.scaler: Optional[DynamicLossScaler] = None
        if precision == "16-mixed":
            # the device type is only known once connected when `device=None`; "cpu" never disables the scaler
            self.scaler = DynamicLossScaler(device or "cpu", **{**_SCALER_DEFAULTS, **given})
        self.history = ScaleHistory()
        #: callables run on every skipped step whose skip the host knows (see :class:`SkipEvent`)
        self.skip_listeners: list[Callable[[SkipEvent], None]] = []
        #: callables ``(optimizer, step)`` run just before an optimizer's gradients are unscaled (16-mixed)
        self.before_unscale_listeners: list[Callable[[Optimizer, int], None]] = []
        #: when True, a skip decided on the device (fused optimizers) is read on the host each step (one sync)
        self.sync_skips = False
        self._module: Optional[pl.LightningModule] = None
        self._cycle_step: Optional[int] = None
        self._cycle_optimizers: list[Optimizer] = []
        self._bf16_found: dict[int, Tensor] = {}
        self._bf16_cycle_found: Optional[Tensor] = None
        self._bf16_skipped: dict[int, Union[bool, Tensor]] = {}
        self._last_cycle_skipped: Union[bool, Tensor, None] = None
        self._one: Optional[Tensor] = None
        self._wrapped_scheduler_hook = False

    # ------------------------------------------------------------------ set-up
    @override
    def connect(self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple:
        module = _find_lightning_module(model)
        self._module = module
        if module is not None and module._trainer is not None:
            device_type = module.trainer.strategy.root_device.type
            if self.device is None:
                self.device = device_type
            if self.scaler is not None:
                self.scaler._device = self.device
        if self.scaler is not None:
            for optimizer in optimizers:
                if isinstance(optimizer, LBFGS):
                    raise ValueError(
                        f"`{type(self).__name__}(precision='16-mixed')` cannot train with `torch.optim.LBFGS`: LBFGS"
                        " re-evaluates the closure inside `step()`, which loss scaling breaks. HINT: use"
                        " precision='bf16-mixed' or 32-bit precision with LBFGS."
                    )
        if module is not None and module.automatic_optimization and self.skip_scheduler_on_overflow:
            self._wrap_scheduler_hook(module)
        if module is not None and self.fp32_modules:
            self._islands.install(module, self.device or "cpu")
        return model, optimizers, lr_schedulers

    @property
    def fp32_module_names(self) -> list[str]:
        """The qualified names of the modules running as fp32 islands (empty before the model is connected)."""
        return list(self._islands.names)

    @override
    def teardown(self) -> None:
        self._apply_pending_update()
        self.history.flush()
        self._islands.remove()
        if self._module is not None and self._wrapped_scheduler_hook:
            self._module.__dict__.pop("lr_scheduler_step", None)
            self._wrapped_scheduler_hook = False

    # ------------------------------------------------------------------ autocast
    def autocast_context_manager(self) -> torch.autocast:
        """The autocast context of this precision on the connected device."""
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Enable autocast."""
        with self.autocast_context_manager():
            yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """Autocast the training step; in manual optimization, close the cycle after the batch's last step."""
        with self.forward_context():
            yield
        module = self._module
        if module is not None and not module.automatic_optimization:
            self._apply_pending_update()

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # a cycle stays open across backward calls within one batch (a GAN's second backward uses the same scale)
        tensor = super().pre_backward(tensor, module)  # hooks see the true (unscaled) loss
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return tensor

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # `training_step` returned None: no backward ran, nothing to unscale or step (as stock Lightning)
            return closure_result
        self._begin(optimizer, model)
        self._unscale(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks and clipping see true gradients
        step_output = self._step(optimizer, **kwargs)
        if model.automatic_optimization:
            self._end_cycle()
        return step_output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip true gradients: unscale first (once per cycle) when it has not happened yet (manual optimization)."""
        if clip_val > 0:
            self._begin(optimizer, self._module)
            self._unscale(optimizer)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def _begin(self, optimizer: Optimizer, module: Optional[pl.LightningModule]) -> None:
        if self._stepped_in_cycle(optimizer):
            # the same optimizer steps twice before the cycle closed: close it first
            self._apply_pending_update()
        if self._cycle_step is None:
            self._cycle_step = module.trainer.global_step if module is not None and module._trainer else 0
            if self._cycle_step is not None and self.history.last_step is not None:
                self._cycle_step = max(self._cycle_step, self.history.last_step + 1)
            self._bf16_skipped.clear()
            if self.scaler is not None:
                self.scaler._last_skipped.clear()

    def _stepped_in_cycle(self, optimizer: Optimizer) -> bool:
        return any(o is optimizer for o in self._cycle_optimizers)

    def _unscale(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            if not self.scaler.is_unscaled(optimizer):
                for listener in list(self.before_unscale_listeners):
                    listener(optimizer, self._cycle_step if self._cycle_step is not None else 0)
                self.scaler.unscale_(optimizer)
        elif self.skip_nonfinite and id(optimizer) not in self._bf16_found:
            self._bf16_found[id(optimizer)] = _nonfinite_flag(optimizer)

    def _step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self._cycle_optimizers.append(optimizer)
        if self.scaler is not None:
            return self.scaler.step(optimizer, **kwargs)
        found = self._bf16_found.pop(id(optimizer), None)
        if found is None:
            return optimizer.step(**kwargs)
        self._bf16_cycle_found = found if self._bf16_cycle_found is None else self._bf16_cycle_found + found
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # fused kernels skip on the device: no host sync
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                output = optimizer.step(**kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            self._bf16_skipped[id(optimizer)] = found > 0
            return output
        skipped = bool(found.item())
        self._bf16_skipped[id(optimizer)] = skipped
        return None if skipped else optimizer.step(**kwargs)

    def _apply_pending_update(self) -> None:
        if self._cycle_optimizers:
            self._end_cycle()

    def _end_cycle(self) -> None:
        """Record the cycle in the history, update the scale once, and tell the listeners about a known skip."""
        step = self._cycle_step if self._cycle_step is not None else 0
        optimizers = self._cycle_optimizers
        scale_before: Optional[float] = None
        if self.scaler is not None:
            scale = self.scaler.scale_tensor()
            found = self.scaler.found_inf()
            assert scale is not None
            self.history.record(step, scale, found)
            skipped = self._cycle_skipped(optimizers)
            if skipped is True:
                scale_before = float(scale.item())  # only on skipped steps
            self.scaler.update()
        else:
            found_bf16, self._bf16_cycle_found = self._bf16_cycle_found, None
            if found_bf16 is None:
                self.history.record(step, 1.0, 0.0)
            else:
                if self._one is None or self._one.device != found_bf16.device:
                    self._one = torch.ones((), device=found_bf16.device)
                self.history.record(step, self._one, found_bf16)
            skipped = self._cycle_skipped(optimizers)
            scale_before = 1.0
        self._last_cycle_skipped = skipped
        self._cycle_optimizers = []
        self._cycle_step = None
        if skipped is True and self.skip_listeners:
            new_scale = self.scaler.get_scale() if self.scaler is not None else 1.0
            skipped_optimizers = [o for o in optimizers if self.step_was_skipped(o)]
            event = SkipEvent(
                step=step, scale=float(scale_before or 1.0), new_scale=new_scale, optimizers=skipped_optimizers
            )
            for listener in list(self.skip_listeners):
                listener(event)

    def _cycle_skipped(self, optimizers: list[Optimizer]) -> Union[bool, None]:
        """Whether some optimizer of the cycle skipped: known on the host, or None (decided on the device)."""
        outcome: Union[bool, None] = False
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
        """Whether the last optimizer-step cycle was skipped (reads the device flag for fused optimizers)."""
        value = self._last_cycle_skipped
        if value is None:
            value = self._cycle_skipped_resolved()
        return bool(value)

    def _cycle_skipped_resolved(self) -> bool:
        flags = [v for v in (self.scaler._last_skipped if self.scaler else self._bf16_skipped).values()]
        resolved = any(bool(f.item()) if isinstance(f, Tensor) else f for f in flags)
        self._last_cycle_skipped = resolved
        return resolved

    @property
    def skip_known_on_host(self) -> bool:
        """Whether the host already knows if the last cycle was skipped (False: a fused optimizer decided it)."""
        return self._last_cycle_skipped is not None

    @property
    def applied_steps(self) -> int:
        """Optimizer-step cycles that updated the weights (recorded cycles minus skipped ones)."""
        return self.history.num_steps - self.history.num_skipped

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 for bf16-mixed). Reads the device value: one host sync."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    # ------------------------------------------------------------------ schedulers
    def _wrap_scheduler_hook(self, module: pl.LightningModule) -> None:
        if self._wrapped_scheduler_hook:
            return
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if self._scheduler_step_was_skipped(module, scheduler):
                return None
            return original(scheduler, metric)

        module.__dict__["lr_scheduler_step"] = lr_scheduler_step
        self._wrapped_scheduler_hook = True

    def _scheduler_step_was_skipped(self, module: pl.LightningModule, scheduler: Any) -> bool:
        configs = [c for c in module.trainer.lr_scheduler_configs if c.scheduler is scheduler]
        if not configs or configs[0].interval != "step":
            return False
        optimizer = getattr(scheduler, "optimizer", None)
        if optimizer is None:
            return False
        return bool(self.step_was_skipped(optimizer, sync=True))

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        self._apply_pending_update()
        state: dict[str, Any] = {"precision": self.precision, "history": self.history.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" in state_dict and self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        elif self.scaler is not None and "scale" in state_dict:  # a stock MixedPrecision/GradScaler state
            self.scaler.load_state_dict(state_dict)
        if "history" in state_dict:
            self.history.load_state_dict(state_dict["history"])


def _find_lightning_module(model: torch.nn.Module) -> Optional[pl.LightningModule]:
    for module in model.modules():
        if isinstance(module, pl.LightningModule):
            return module
    return None


def _nonfinite_flag(optimizer: Optimizer) -> Tensor:
    """A device flag (> 0) telling whether any gradient of ``optimizer`` holds inf/nan; read-only, no host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grad = param.grad._values() if param.grad.is_sparse else param.grad
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
    flags = []
    for grads in groups.values():
        norms = torch._foreach_norm(grads, float("inf"))  # max |g| per tensor; inf/nan propagate
        flags.append(torch.stack(norms).isfinite().logical_not().any().float())
    if not flags:
        rank_zero_warn("`AmpPlusPrecision`: an optimizer stepped without any gradient.")
        return torch.zeros(())
    first = flags[0]
    return sum((f.to(first.device) for f in flags[1:]), first)
