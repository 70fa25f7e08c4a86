"""AmpPlusFSDPPrecision: the Lightning adapter for ``FSDPStrategy`` (FSDP1), beside ``AmpPlusPrecision``.

Everything is ``AmpPlusPrecision``'s (engine, history, exact clipping, skip bookkeeping, callbacks); what sharding
changes is three things: the skip decision reduces its flag across ranks in both precisions
(``ShardedDynamicLossScaler`` for 16-mixed, a sharded ``NonFiniteChecker`` for bf16-mixed), clipping
by norm clips the global norm through FSDP's own ``clip_grad_norm_``, and FSDP's ``MixedPrecision`` keeps float32
parameters and float32 gradient reduction unless asked otherwise (autocast does the fp16/bf16 compute).
``FSDPStrategy`` accepts it because it is an ``FSDPPrecision``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.plugins.precision.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus._repr import given_arguments
from lightning_amp_plus._validation import check_choice
from lightning_amp_plus.precision import AmpPlusPrecision

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class AmpPlusFSDPPrecision(AmpPlusPrecision, FSDPPrecision):  # type: ignore[misc]
    """``AmpPlusPrecision`` for Lightning's ``FSDPStrategy``: the same knobs, attributes and callbacks.

    ``FSDPStrategy`` accepts only ``FSDPPrecision`` instances, hence the second base: ``AmpPlusPrecision`` comes
    first and overrides every step of the flow (its ``scaler`` and ``optimizer_step`` replace FSDPPrecision's, which
    mypy flags on the class line); FSDPPrecision contributes only the module and input conversions.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: as for ``AmpPlusPrecision``.
        param_dtype: FSDP ``MixedPrecision.param_dtype``: the dtype FSDP gathers parameters in for compute
            (``"float32"`` by default: autocast casts per op, and fp32 islands stay exact; ``"float16"`` or
            ``"bfloat16"`` halves the all-gather traffic, as stock ``FSDPPrecision`` does).
        reduce_dtype: FSDP ``MixedPrecision.reduce_dtype``: the dtype gradients are reduce-scattered in
            (``"float32"`` by default: no precision lost in the sum; a half dtype halves the traffic).
        **kwargs: every other argument of ``AmpPlusPrecision`` (the scaler knobs, ``skip_nonfinite``,
            ``warn_skip_streak``, ``skip_scheduler_on_overflow``, ``fp32_modules``).

    Example:
        >>> from lightning_amp_plus import AmpPlusFSDPPrecision
        >>> plugin = AmpPlusFSDPPrecision("16-mixed", growth_interval=500)
        >>> type(plugin.scaler).__name__, plugin.mixed_precision_config.param_dtype
        ('ShardedDynamicLossScaler', torch.float32)
    """

    _stock_key = "FSDPPrecision"
    _sharded = True

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: Optional[str] = None,
        *,
        param_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        reduce_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        **kwargs: Any,
    ) -> None:
        given = given_arguments(AmpPlusFSDPPrecision.__init__, locals())
        super().__init__(precision, device, **kwargs)
        self._given = {**given, **self._given}  # the knobs in **kwargs: as AmpPlusPrecision tells them
        owner = type(self).__name__
        check_choice(owner, "param_dtype", param_dtype, tuple(_DTYPES))
        check_choice(owner, "reduce_dtype", reduce_dtype, tuple(_DTYPES))
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self._desired_input_dtype = torch.float32  # FSDPPrecision's: inputs and new tensors stay float32

    @property
    def mixed_precision_config(self) -> TorchMixedPrecision:
        """FSDP's ``MixedPrecision``: float32 parameters and reduction unless another dtype was given."""
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

        return TorchMixedPrecision(param_dtype=_DTYPES[self.param_dtype], reduce_dtype=_DTYPES[self.reduce_dtype])

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip the global norm over every rank's shards (FSDP's ``clip_grad_norm_``), after the unscale."""
        root = self._fsdp_root()
        if root is None:  # not wrapped (yet): a plain module
            Precision.clip_grad_by_norm(self, optimizer, clip_val)
            return
        root.clip_grad_norm_(clip_val)

    def _fsdp_root(self) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel

        module = self._module
        if module is None or module._trainer is None:
            return None
        model = module.trainer.strategy.model
        return model if isinstance(model, FullyShardedDataParallel) else None
