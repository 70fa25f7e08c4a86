"""DynamicLossScaler: a bounded, hysteresis-aware ``torch.amp.GradScaler``.

Torch only (no Lightning import): usable in a plain PyTorch loop exactly like ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from lightning_amp_plus._validation import check_bool, check_scaler_args


class DynamicLossScaler(torch.amp.GradScaler):
    """Dynamic loss scaler with scale bounds and hysteresis (Megatron's rule, bounded).

    Per optimizer-step cycle (one :meth:`update`):

    * overflow (inf/nan in any unscaled gradient): the step is skipped; growth tracker := 0; hysteresis tracker -= 1;
      if it is now <= 0: ``scale := max(scale * backoff_factor, min_scale)``.
    * clean step: growth tracker += 1; when it reaches ``growth_interval``: growth tracker := 0, hysteresis
      tracker := ``hysteresis``, ``scale := min(scale * growth_factor, max_scale)`` (a product that is not finite
      leaves the scale unchanged, as in torch).

    With ``min_scale=0, max_scale=inf, hysteresis=1`` it is ``torch.amp.GradScaler`` exactly. :meth:`update` runs on
    the device (no host sync). :meth:`state_dict` carries every tracker.

    Args:
        device: device type of the gradients, as for ``torch.amp.GradScaler`` (``"cuda"``, ``"cpu"``, ...).
        init_scale: initial scale.
        growth_factor: factor (> 1) applied after ``growth_interval`` clean steps in a row.
        backoff_factor: factor in (0, 1) applied on overflow.
        growth_interval: clean steps in a row before the scale grows.
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this.
        hysteresis: overflows tolerated (steps skipped, scale kept) before the scale backs off; a growth resets it.
        enabled: ``False`` turns every method into a pass-through, as in torch.

    Example:
        >>> import torch
        >>> from lightning_amp_plus import DynamicLossScaler
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=2, max_scale=2.0**11)
        >>> for _ in range(6):
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         loss = model(torch.randn(8, 4)).float().pow(2).mean()
        ...     scaler.scale(loss).backward()
        ...     scaler.step(opt)
        ...     scaler.update()
        ...     opt.zero_grad()
        >>> scaler.get_scale()  # grew once to max_scale, then stayed there
        2048.0
    """

    def __init__(
        self,
        device: str = "cuda",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        enabled: bool = True,
    ) -> None:
        owner = type(self).__name__
        check_scaler_args(
            owner,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )
        check_bool(owner, "enabled", enabled)
        super().__init__(
            device,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale)
        self._hysteresis = hysteresis
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: Tensor | None = None
        self._found_inf_combined: Tensor | None = None
        # per optimizer (id): whether its last step was skipped; a bool when the host knows it (torch already
        # synced to decide), else the device flag (fused optimizers decide on the device).
        self._last_skipped: dict[int, bool | list[Tensor]] = {}

    # ------------------------------------------------------------------ knobs
    @property
    def min_scale(self) -> float:
        """The lower bound of the scale."""
        return self._min_scale

    @property
    def max_scale(self) -> float:
        """The upper bound of the scale."""
        return self._max_scale

    @property
    def hysteresis(self) -> int:
        """Overflows tolerated before backing off."""
        return self._hysteresis

    def set_device_type(self, device: str) -> None:
        """Set the device type once it is known (a plugin built with ``device=None`` learns it from the trainer)."""
        self._device = device

    def scale_tensor(self) -> Tensor | None:
        """The current scale as a device tensor (no sync), or ``None`` before the first :meth:`scale`."""
        return self._scale if self._enabled else None

    # ------------------------------------------------------------------ lazy init
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)

    # ------------------------------------------------------------------ step bookkeeping
    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # the one host sync torch itself needs to decide the skip of a non-fused optimizer; we keep what it learns
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._last_skipped[id(optimizer)] = skipped
        return None if skipped else optimizer.step(*args, **kwargs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done already), then step ``optimizer`` unless its gradients hold inf/nan."""
        if self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = super().step(optimizer, *args, **kwargs)
            # the fused kernel decided on the device: keep its flags, read them only if someone asks
            self._last_skipped[id(optimizer)] = list(
                self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            )
            return retval
        return super().step(optimizer, *args, **kwargs)

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`unscale_` already ran for ``optimizer`` in this cycle."""
        if not self._enabled or id(optimizer) not in self._per_optimizer_states:
            return False
        return self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED

    def step_was_skipped(self, optimizer: torch.optim.Optimizer, *, sync: bool = True) -> bool | None:
        """Whether the last step of ``optimizer`` was skipped (``None`` if it has not stepped).

        Free for non-fused optimizers (torch already read the flag). For fused optimizers the flag lives on the
        device: ``sync=True`` reads it (one host sync), ``sync=False`` returns ``None``.
        """
        return self._skipped(id(optimizer), sync)

    def any_step_skipped(self) -> bool:
        """Whether any optimizer's last step was skipped (reads the device flags of fused optimizers)."""
        return any(self._skipped(key, True) for key in list(self._last_skipped))

    def forget_skips(self) -> None:
        """Forget the last steps' outcomes (a new cycle begins)."""
        self._last_skipped.clear()

    def _skipped(self, key: int, sync: bool) -> bool | None:
        value = self._last_skipped.get(key)
        if value is None or isinstance(value, bool):
            return value
        if not sync:
            return None
        resolved = bool(sum(v.item() for v in value))
        self._last_skipped[key] = resolved
        return resolved

    def found_inf(self) -> Tensor:
        """The combined overflow flag of this cycle (a device tensor, > 0 on overflow), as :meth:`update` uses it."""
        if self._found_inf_combined is None:
            scale, _ = self._check_scale_growth_tracker("found_inf")
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found_infs[0]
            for extra in found_infs[1:]:
                combined = combined + extra
            self._found_inf_combined = combined
        return self._found_inf_combined

    # ------------------------------------------------------------------ the rule
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Apply the bounded hysteresis rule for the cycle that just ended (on the device, no host sync)."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            self._found_inf_combined = None
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_inf = self.found_inf()
        if self._hysteresis == 1:
            # torch's own fused kernel, then the bounds: bit-identical to GradScaler when the bounds are (0, inf)
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf, self._growth_factor, self._backoff_factor, self._growth_interval
            )
            if self._min_scale > 0 or math.isfinite(self._max_scale):
                scale.clamp_(min=self._min_scale, max=self._max_scale)
        else:
            self._update_with_hysteresis(scale, growth_tracker, found_inf)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._found_inf_combined = None

    def _update_with_hysteresis(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        assert self._hysteresis_tracker is not None
        hysteresis = self._hysteresis_tracker
        found = found_inf > 0
        succeeded = growth_tracker + 1
        grow = found.logical_not() & (succeeded >= self._growth_interval)
        growth_tracker.copy_(torch.where(found | grow, 0, succeeded))
        hysteresis.copy_(
            torch.where(found, (hysteresis - 1).clamp_min(0), torch.where(grow, self._hysteresis, hysteresis))
        )
        backoff = found & (hysteresis <= 0)
        grown = _times(scale, self._growth_factor)
        grown = torch.where(grown.isfinite(), grown, scale).clamp_max(self._max_scale)
        shrunk = _times(scale, self._backoff_factor).clamp_min(self._min_scale)
        scale.copy_(torch.where(backoff, shrunk, torch.where(grow, grown, scale)))

    # ------------------------------------------------------------------ state
    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """Torch's scaler state plus the bounds and the hysteresis tracker."""
        state = super().state_dict()
        if self._enabled:
            state.update(
                min_scale=self._min_scale,
                max_scale=self._max_scale,
                hysteresis=self._hysteresis,
                _hysteresis_tracker=self._get_hysteresis_tracker(),
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (a plain ``GradScaler`` state loads too, keeping our bounds)."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_hysteresis_tracker"] = None
            state["_found_inf_combined"] = None
            state["_last_skipped"] = {}
        return state


def _times(scale: Tensor, factor: float) -> Tensor:
    """``scale * factor`` rounded once to float32, as torch's update kernel computes it (in double)."""
    if scale.device.type == "mps":  # no float64 there
        return scale * factor
    return (scale.double() * factor).float()
