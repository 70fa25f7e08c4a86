"""AmpPlusFabricPrecision: the same engine (scaler, history, skip reporting) for Lightning Fabric."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal, Optional

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._validation import check_choice
from lightning_amp_plus.engine import SCALER_DEFAULTS, AmpEngine, EngineView, make_engine, refuse_closure_optimizer
from lightning_amp_plus.knobs import knob_values


def _convert(tensor: Tensor, dst_type: torch.dtype) -> Tensor:
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


class AmpPlusFabricPrecision(KnobsRepr, EngineView, FabricPrecision):
    """Fabric precision plugin sharing :class:`~lightning_amp_plus.engine.AmpEngine` with ``AmpPlusPrecision``.

    Same arguments and defaults as ``AmpPlusPrecision`` for the scaler (``init_scale`` ... ``hysteresis``) and
    ``skip_nonfinite``, and ``scaler=`` (a scaler of your own, as stock Fabric ``MixedPrecision`` takes one; its
    ``scale``, ``unscale_``, ``step`` and ``update`` are called); the same ``.scaler``, ``.history``, ``.listen()``,
    ``.optimizer_step_was_skipped`` and ``.applied_steps``. ``fabric.clip_gradients`` unscales first, fused
    optimizers included. A step index is the count of optimizer-step cycles so far.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: device type for autocast; ``None``: ``"cuda"`` when available, else ``"cpu"``.
        warn_skip_streak: warn once this many updates in a row were skipped (default ``50``; ``None``: never).
        update: ``"step"`` (default) updates the scale after every ``optimizer.step()``, torch's single-optimizer
            recipe. ``"manual"``: call :meth:`update` once per iteration after all optimizers stepped, torch's
            recipe for several optimizers (the scale then backs off once, and every optimizer unscales with the
            scale its gradients were scaled with).

    Example:
        >>> import torch
        >>> from lightning.fabric import Fabric
        >>> from lightning_amp_plus import AmpPlusFabricPrecision
        >>> plugin = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**10)
        >>> fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        >>> model = fabric.setup_module(torch.nn.Linear(4, 1))
        >>> opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> loss = model(torch.randn(8, 4)).float().pow(2).mean() * float("inf")
        >>> fabric.backward(loss)
        >>> opt.step()
        >>> plugin.history.skipped_steps, plugin.loss_scale
        ([0], 512.0)
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: Optional[str] = None,
        *,
        init_scale: Optional[float] = SCALER_DEFAULTS["init_scale"],
        growth_factor: Optional[float] = SCALER_DEFAULTS["growth_factor"],
        backoff_factor: Optional[float] = SCALER_DEFAULTS["backoff_factor"],
        growth_interval: Optional[int] = SCALER_DEFAULTS["growth_interval"],
        min_scale: Optional[float] = SCALER_DEFAULTS["min_scale"],
        max_scale: Optional[float] = SCALER_DEFAULTS["max_scale"],
        hysteresis: Optional[int] = SCALER_DEFAULTS["hysteresis"],
        scaler: Optional[torch.amp.GradScaler] = None,
        skip_nonfinite: bool = True,
        warn_skip_streak: Optional[int] = 50,
        update: Literal["step", "manual"] = "step",
    ) -> None:
        knobs = knob_values({name: value for name, value in locals().items() if name in SCALER_DEFAULTS})
        self._given = given_arguments(AmpPlusFabricPrecision.__init__, {**locals(), **knobs})
        owner = type(self).__name__
        self._engine: AmpEngine = make_engine(
            owner, precision, device, skip_nonfinite, knobs, warn_skip_streak, scaler=scaler
        )
        if scaler is not None:
            self._given["scaler"] = self._engine.scaler  # the scaler in use (a GradScaler given: the one taken)
        check_choice(owner, "update", update, ("step", "manual"))
        self.precision = precision  # type: ignore[assignment]
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.scaler is not None:
            self.scaler.set_device_type(self.device)
        self.update_mode = update
        self._dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16

    @override
    def forward_context(self) -> AbstractContextManager:
        return torch.autocast(self.device, dtype=self._dtype, cache_enabled=False)

    @override
    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert, dtype=Tensor, dst_type=self._dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        super().backward(self._engine.scale(tensor), model, *args, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale once per cycle (``fabric.clip_gradients`` calls this), fused optimizers included.

        With no backward since the optimizer last stepped (nothing scaled) it does nothing.
        """
        optimizer = resolve_optimizer(optimizer)
        if not self._engine.has_new_gradients(optimizer):
            return
        self._engine.begin(optimizer)
        self._engine.unscale(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step (or skip) and, with ``update="step"``, close the update.

        A closure (``optimizer.step(closure)``, LBFGS) is evaluated inside the step, and in bf16-mixed each evaluation
        is checked after it ran: a step that met inf/nan is undone. 16-mixed refuses closures (loss scaling breaks
        them).
        """
        # Fabric hands the optimizer itself (its wrapper's `step` passes `.optimizer`); the scaler resolves what else
        if self.scaler is not None:
            refuse_closure_optimizer(type(self).__name__, optimizer)
        if self.scaler is not None and self.scaler.scale_tensor() is None:
            raise RuntimeError(
                f"`{type(self).__name__}(precision='16-mixed')`: `optimizer.step()` found no scaled loss: nothing went"
                " through `fabric.backward`. HINT: call `fabric.backward(loss)` (it scales the loss) instead of"
                " `loss.backward()`."
            )
        engine = self._engine
        engine.begin(optimizer)
        try:
            if "closure" not in kwargs:  # a closure's gradients exist only inside the step: checked there
                engine.unscale(optimizer)
            output = engine.step(optimizer, **kwargs)
        except BaseException:
            engine.abort_cycle()  # a loop that catches it continues with a clean cycle, never a stale unscale
            raise
        if self.update_mode == "step":
            engine.end_cycle()
        return output

    def update(self) -> None:
        """Close the iteration (``update="manual"``): record it and update the scale once."""
        self._engine.apply_pending_update()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state, or stock Fabric ``MixedPrecision``'s (a plain ``GradScaler`` state)."""
        self._engine.load_state_dict(state_dict, where=f"{type(self).__name__}.load_state_dict")

    @override
    def teardown(self) -> None:
        self._engine.apply_pending_update()
        self._engine.history.flush()
