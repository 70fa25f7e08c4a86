"""AmpPlusPrecision: the Lightning precision plugin, a thin adapter over :class:`~lightning_amp_plus.engine.AmpEngine`.

The flow a loss takes, top to bottom: autocast forward -> hooks see the true loss -> scale -> backward ->
unscale once per optimizer per cycle -> hooks and clipping see true gradients -> step (or skip) -> record in the
history -> update the scale once per cycle (after the batch's last optimizer step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._log import say
from lightning_amp_plus._repr import KnobsRepr, given_arguments, same_value
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._validation import check_bool, check_choice
from lightning_amp_plus.auto_islands import AutoIslands
from lightning_amp_plus.engine import (
    SCALER_DEFAULTS,
    AmpEngine,
    EngineView,
    SkipEvent,
    make_engine,
    refuse_closure_optimizer,
    warn_unstepped,
)
from lightning_amp_plus.islands import Fp32Islands, check_entries
from lightning_amp_plus.knobs import knob_values

__all__ = ["AmpPlusPrecision", "SkipEvent"]


class AmpPlusPrecision(KnobsRepr, EngineView, Precision):
    """Mixed precision with a bounded dynamic loss scaler, unscale-before-clip and skip bookkeeping.

    Args:
        precision: ``"16-mixed"`` (float16 autocast with loss scaling) or ``"bf16-mixed"`` (bfloat16, no scaling).
        device: device type for autocast and the scaler; ``None`` means the trainer's accelerator type.
        init_scale: initial loss scale (16-mixed).
        growth_factor: scale multiplier after ``growth_interval`` clean steps.
        backoff_factor: scale multiplier on overflow.
        growth_interval: clean steps in a row before the scale grows.
        min_scale: lower bound of the scale.
        max_scale: upper bound of the scale.
        hysteresis: overflows tolerated before the scale backs off (1: back off on every overflow).
        scaler: a loss scaler of your own instead of the knobs, as stock ``MixedPrecision(scaler=...)`` takes one: a
            :class:`~lightning_amp_plus.DynamicLossScaler` (a subclass included: its overrides of ``scale``,
            ``unscale_``, ``step`` and ``update`` are called), or a ``torch.amp.GradScaler``, whose knobs and state
            are taken (:meth:`~lightning_amp_plus.DynamicLossScaler.from_grad_scaler`: torch's rule exactly).
        skip_nonfinite: bf16-mixed only: skip optimizer steps whose gradients hold inf/nan (default ``True``).
            Costs one host sync per step with a non-fused optimizer. 16-mixed always skips.
        warn_skip_streak: warn (``AmpPlusWarning``) once this many optimizer updates in a row were skipped, so a run
            that trains on nothing says so even without ``NaNSkipReporter`` (default ``50``; ``None``: never).
        skip_scheduler_on_overflow: do not advance step-interval LR schedulers on skipped steps (default ``True``).
        fp32_modules: modules to run in float32 with autocast disabled ("fp32 islands"): module classes, their
            import paths (``"torch.nn.LayerNorm"``), or qualified names / glob patterns as in ``named_modules()``
            (``"head"``, ``"encoder.*.attn"``). Installed when the model is connected, removed at teardown;
            ``state_dict()`` keys never change. An entry that matches nothing is an error.
        backoff_on: which skips back the loss scale off: ``"any"`` (torch's rule, the default) or ``"backward"``: a
            skip whose loss already held inf/nan before scaling (the batch, the forward, the loss) is skipped and
            told as always, and the scale and its trackers are left alone (no scale causes it). Decided on the
            device from the losses the plugin scales (every micro-batch), no host read; under DDP any rank's
            non-finite loss counts for every rank. 16-mixed only.
        auto_islands: find the fp32 islands by observation (16-mixed): a module the watch names as the birthplace
            of a float16 overflow (finite inputs, inf/nan out) runs in float32 from the next step; the consumer an
            island's float32 output overflows joins the same way; an island that makes inf/nan again in float32 is
            taken out (the model's own). Nothing of your code runs twice. Each island is said, counted in the
            logger (``amp/auto_islands``), kept in checkpoints, and the end of fit prints the ``fp32_modules=[...]``
            line for the next run. The watch starts after the first skip whose loss held inf/nan. Under bf16-mixed
            nothing is added (no float16 range to escape). Refused by ``AmpPlusFSDPPrecision`` and sharded
            strategies (their modules are not watched).

    The scaler knobs (their defaults: :data:`lightning_amp_plus.knobs.DEFAULTS`, as the signature shows) are for
    ``"16-mixed"``; giving one with ``"bf16-mixed"`` is an error.

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

    #: the checkpoint key of the stock plugin this one stands in for (its scaler state is written there too)
    _stock_key = "MixedPrecision"
    #: each rank holds a shard of the gradients: the skip flag is reduced over the ranks (FSDP)
    _sharded = False

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
        skip_scheduler_on_overflow: bool = True,
        fp32_modules: Optional[list[Union[str, type[torch.nn.Module]]]] = None,
        backoff_on: Literal["any", "backward"] = "any",
        auto_islands: bool = False,
    ) -> None:
        knobs = knob_values({name: value for name, value in locals().items() if name in SCALER_DEFAULTS})
        self._given = given_arguments(AmpPlusPrecision.__init__, {**locals(), **knobs})
        owner = type(self).__name__
        self._engine: AmpEngine = make_engine(
            owner, precision, device, skip_nonfinite, knobs, warn_skip_streak, sharded=self._sharded, scaler=scaler
        )
        if scaler is not None:
            self._given["scaler"] = self._engine.scaler  # the scaler in use (a GradScaler given: the one taken)
        check_bool(owner, "skip_scheduler_on_overflow", skip_scheduler_on_overflow)
        check_choice(owner, "backoff_on", backoff_on, ("any", "backward"))
        if backoff_on != "any" and precision == "bf16-mixed":
            raise ValueError(
                f"`{owner}(precision='bf16-mixed', backoff_on={backoff_on!r})` is invalid: bf16-mixed has no loss"
                " scale to back off. HINT: leave `backoff_on` out, or use precision='16-mixed'."
            )
        self._engine.backoff_on = self.backoff_on = backoff_on
        self.auto_islands = check_bool(owner, "auto_islands", auto_islands)
        if auto_islands and self._sharded:
            raise ValueError(
                f"`{owner}(auto_islands=True)` is invalid: a sharded model's modules are not watched, so no island can"
                " be found by observation. HINT: find them in a run without sharding (or with"
                " `NaNSkipReporter`'s skip lines), then give `fp32_modules=[...]`."
            )
        self.precision: Literal["16-mixed", "bf16-mixed"] = precision
        self.device = device
        self.skip_nonfinite = skip_nonfinite
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.fp32_modules = check_entries(owner, fp32_modules)
        self._islands = Fp32Islands(self.fp32_modules)
        self._auto: Optional[AutoIslands] = (
            AutoIslands(
                self._island_names, self._add_island, self._take_out_island, self._tell_auto, self._count_islands
            )
            if auto_islands and precision == "16-mixed"
            else None
        )
        self._auto_fit = False  # this fit ran with the watch attached (its end prints the fix line)
        self._module: Optional[pl.LightningModule] = None
        self._wrapped_scheduler_hook = False
        self._user_scheduler_hook: Any = _MISSING  # a user's own instance-level `lr_scheduler_step`, restored later
        self._fit_scope = FitScope()
        self._no_step = False  # inside the hooks of an automatic step whose `training_step` returned None
        self._in_closure_step = False  # inside the hooks a closure optimizer (LBFGS) runs within its step

    @property
    def fp32_module_names(self) -> list[str]:
        """The qualified names of the modules running as fp32 islands (empty before the model is connected).

        A module replaced under its name mid-fit (a new instance) is not one until it is made an island again.
        """
        return self._islands.running(self._module)

    def _islands_as_run(self) -> list[str]:
        """The islands this step ran with: a skip is judged by them (``auto_islands`` may have changed them at it)."""
        running = self._islands.running(self._module)
        return self._auto.as_run(running) if self._auto is not None else running

    # ------------------------------------------------------------------ set-up
    @override
    def connect(self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple:
        # Lightning's model summary knows no "-mixed" precision and says so on every run; the float32 sizes it then
        # shows are the right ones (mixed precision keeps float32 weights)
        warnings.filterwarnings("ignore", message=_SUMMARY_WARNING)
        module = _find_lightning_module(model)
        self._module = module
        trainer = module._trainer if module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and self._fit_scope.starts_afresh(trainer):
            # a new Trainer's fit starts afresh; another fit of the same Trainer continues, as its step counters do
            self._engine.reset()
            if self._auto is not None:
                self._auto.reset()
        self._engine.register(optimizers)
        if module is not None and module._trainer is not None:
            root = module.trainer.strategy.root_device.type
            if self.device is None:
                self.device = root
            elif self.device != root:
                raise ValueError(
                    f"`{type(self).__name__}(device={self.device!r})` does not match the trainer's device ({root!r}):"
                    " autocast and the scaler would act on no tensor of the model, which would train in float32"
                    f" with no word. HINT: leave `device=None` (the trainer's), or use `accelerator={self.device!r}`."
                )
        if self.scaler is not None:
            self.scaler.set_device_type(self.device or "cpu")
            for optimizer in optimizers:
                refuse_closure_optimizer(type(self).__name__, resolve_optimizer(optimizer))
        if module is not None and module.automatic_optimization and self.skip_scheduler_on_overflow:
            self._wrap_scheduler_hook(module)
        if module is not None and self.fp32_modules:
            self._islands.install(module, self.device or "cpu")
        if self._auto is not None and module is not None and fitting:
            self._attach_auto_islands(module)
        return model, optimizers, lr_schedulers

    def _attach_auto_islands(self, module: pl.LightningModule) -> None:
        """Observe the fit's steps for islands; those found earlier in this Trainer's fits run in float32 again."""
        from lightning_amp_plus.callbacks._common import shards_gradients

        assert self._auto is not None
        trainer = module.trainer
        if shards_gradients(trainer):
            raise ValueError(
                f"`{type(self).__name__}(auto_islands=True)` cannot serve {type(trainer.strategy).__name__}: a sharded"
                " model's modules are not watched. HINT: find the islands in a run without sharding, then give"
                " `fp32_modules=[...]`."
            )
        self._auto.added = [name for name in self._auto.added if self._add_island(name) is None]
        self._auto.attach(module, self.forward_context, getattr(trainer, "accumulate_grad_batches", 1) > 1)
        self._engine.listen(self._auto, first=True)  # an island is in place before a callback's collapse raises
        self._auto_fit = True

    def _island_names(self) -> list[str]:
        return self._islands.running(self._module)

    def _tell_auto(self, line: str) -> None:
        say(f"`{type(self).__name__}(auto_islands=True)`: {line}")

    def _add_island(self, name: str) -> Optional[str]:
        """An island found by observation, on from the next step; why it cannot be, or None."""
        if self._module is None:
            return "no model is connected"
        return self._islands.add(self._module, name, self.device or "cpu")

    def _take_out_island(self, name: str) -> None:
        if self._module is not None:
            self._islands.take_out(self._module, name)

    def _count_islands(self, count: int, step: int) -> None:
        """``amp/auto_islands`` at ``step``: how many islands observation added (rank zero, every logger)."""
        trainer = self._module._trainer if self._module is not None else None
        if trainer is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"amp/auto_islands": float(count)}, step=step)

    def auto_islands_fix(self) -> Optional[str]:
        """The plugin call for the next run, with the islands observation added as ``fp32_modules`` (None: none)."""
        if self._auto is None or not self._auto.added:
            return None
        from lightning_amp_plus.advice import plugin_call
        from lightning_amp_plus.callbacks._common import plugin_arguments

        args = plugin_arguments(self)
        named = [n for n in self._auto.added if n in self._auto.at_start]
        if len(named) == len(self._auto.added):  # every island can be named at the next run's start
            args.pop("auto_islands", None)
        args["fp32_modules"] = [*args.get("fp32_modules", []), *named]  # one made mid-fit: auto_islands finds it
        return plugin_call(type(self).__name__, args)

    @override
    def teardown(self) -> None:
        trainer = self._module._trainer if self._module is not None else None
        if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            self._engine.abort_cycle()  # a failure: let its error through, close what ran
        else:
            self._engine.apply_pending_update()
        self.history.flush()
        # what callbacks attached is per run: a failed fit leaves no listener behind for the next one
        self._engine.clear_listeners()
        if self._auto is not None:
            self._auto.detach()
            fix = self.auto_islands_fix() if self._auto_fit else None
            if fix is not None:
                names = ", ".join(repr(n) for n in self._auto.added)
                say(f"`{type(self).__name__}(auto_islands=True)` ran {names} in float32. For the next run: {fix}")
            self._auto_fit = False
        self._islands.remove()
        if self._module is not None and self._wrapped_scheduler_hook:
            if self._user_scheduler_hook is _MISSING:
                self._module.__dict__.pop("lr_scheduler_step", None)
            else:
                self._module.__dict__["lr_scheduler_step"] = self._user_scheduler_hook
            self._user_scheduler_hook = _MISSING
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
        """Autocast the training step; in manual optimization, close the cycle after the batch's last step.

        A cycle still open when a training step starts was left by an exception: it is closed first (never a
        stale unscale). An exception inside the step closes the cycle too, and propagates.
        """
        for starting in self._engine.step_starting:
            starting()
        if self._in_closure_step:  # evaluated by a closure optimizer inside its step: the step owns the update
            with self.autocast_context_manager():
                yield
            return
        if self._engine.cycle_open:
            self._engine.abort_cycle()
        try:
            with self.autocast_context_manager():
                yield
        except BaseException as error:
            self._engine.abort_cycle()
            if self._auto is not None and self._auto.added and isinstance(error, RuntimeError):
                _name_the_islands(error, self._auto.added)
            raise
        module = self._module
        if module is not None and not module.automatic_optimization:
            pending = self._engine.forget_unstepped()
            if pending:
                warn_unstepped(
                    len(pending),
                    "in this training step",
                    "Their gradients stay unscaled, and a further backward would add scaled gradients to them.",
                )
            self._engine.apply_pending_update()

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Lightning's base hook by name, so hooks see the true loss: FSDPPrecision in the MRO would scale it twice
        tensor = Precision.pre_backward(self, tensor, module)
        if self._auto is not None:
            self._auto.loss(tensor)  # the true loss: read (detached) only on a skipped update
        return self._engine.scale(tensor)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Backward; with fp32 islands, autocast off.

        Manual optimization's ``manual_backward`` runs inside the step's autocast, which would run the islands'
        backward matmuls in half precision.
        """
        if not self._islands.names:
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        with torch.autocast(self.device or "cpu", enabled=False):
            return super().backward(tensor, model, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        # Lightning hands the optimizer itself (LightningOptimizer.step passes its `_optimizer`): nothing to resolve.
        # LBFGS (bf16 only) evaluates the closure itself, so the step, hooks and clipping run inside its step
        evaluates_closure = isinstance(optimizer, LBFGS)
        if not evaluates_closure:
            closure_result = closure()
            if closure_result is None and model.automatic_optimization:
                # `training_step` returned None: the hooks run as in stock, and nothing is unscaled or stepped
                self._no_step = True
                try:
                    self._after_closure(model, optimizer)
                finally:
                    self._no_step = False
                return closure_result

        def closure_and_hooks() -> Any:
            result = closure()
            self._after_closure(model, optimizer)
            return result

        engine = self._engine
        engine.begin(optimizer, logger_step(model))
        self._in_closure_step = evaluates_closure
        try:
            if evaluates_closure:
                step_output = engine.step(optimizer, closure=closure_and_hooks, **kwargs)
            else:
                engine.unscale(optimizer)
                self._after_closure(model, optimizer)  # on_before_optimizer_step hooks and clipping: true gradients
                step_output = engine.step(optimizer, **kwargs)
        except BaseException:
            engine.abort_cycle()  # never a stale unscale: the next step starts a clean cycle
            raise
        finally:
            self._in_closure_step = False
        if model.automatic_optimization:
            engine.end_cycle()
        return step_output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip true gradients: unscale first (once per cycle) when it has not happened yet (manual optimization).

        ``optimizer`` may be the ``LightningOptimizer`` that ``self.optimizers()`` returns. With no backward since
        the optimizer last stepped (nothing scaled) nothing is unscaled, as in stock; in an automatic step whose
        ``training_step`` returned None nothing is clipped (no step follows, and the gradients are still scaled).
        """
        if self._no_step:
            return
        engine = self._engine
        cycle = engine.cycle
        # the automatic step unscaled the optimizer itself before its hooks: nothing to resolve then
        if clip_val > 0 and not self._in_closure_step and (cycle is None or optimizer not in cycle.unscaled):
            real = resolve_optimizer(optimizer)  # manual optimization hands the LightningOptimizer
            if (cycle is None or real not in cycle.unscaled) and engine.has_new_gradients(real):
                engine.begin(real, logger_step(self._module))
                engine.unscale(real)
        if clip_val > 0 and engine.overflowed(optimizer) is True:
            return  # its step is skipped: clipping by an infinite norm would only turn the true inf into nan (inf * 0)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    # ------------------------------------------------------------------ schedulers
    def _wrap_scheduler_hook(self, module: pl.LightningModule) -> None:
        if self._wrapped_scheduler_hook:
            return
        original = module.lr_scheduler_step
        self._user_scheduler_hook = module.__dict__.get("lr_scheduler_step", _MISSING)

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
        # Lightning checks at fit start that each scheduler's `optimizer` is one of the fit's
        return bool(self.step_was_skipped(scheduler.optimizer))  # a fused optimizer's flag is read: one sync

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        state = self._engine.state_dict()
        if self._auto is not None:
            state[_AUTO_KEY] = self._auto.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        auto = state_dict.get(_AUTO_KEY) if isinstance(state_dict, dict) else None  # else the engine names it
        if auto is not None:
            if not (isinstance(auto, dict) and all(isinstance(auto.get(k, []), list) for k in ("added", "own"))):
                raise TypeError(
                    f"`checkpoint[{type(self).__qualname__!r}][{_AUTO_KEY!r}]` is invalid: expected a dict with the"
                    f" lists 'added' and 'own' (module names), got {auto!r}."[:400]
                )
            state_dict = {k: v for k, v in state_dict.items() if k != _AUTO_KEY}
        self._engine.load_state_dict(state_dict, where=f"checkpoint[{type(self).__qualname__!r}]")
        self._name_running_knobs()
        if auto is not None and self._auto is not None:
            self._auto.load_state_dict(auto)
        elif auto is not None and auto.get("added"):
            names = ", ".join(f'"{n}"' for n in auto["added"])
            say(
                f"`{type(self).__name__}`: the checkpoint's islands found by observation ({names}) do not run:"
                f" auto_islands is off. HINT: give `fp32_modules=[{names}]`, or `auto_islands=True`."
            )

    def __repr__(self) -> str:
        self._name_running_knobs()  # a knob set on the scaler since (`set_growth_interval`): named as it runs
        return super().__repr__()

    def _name_running_knobs(self) -> None:
        """The repr, the logged call and the fix lines name the knobs that run (after a checkpoint loaded, say)."""
        scaler = self.scaler
        if scaler is None or "scaler" in self._given:
            return
        for name, value in scaler.knobs().items():
            if name == "init_scale":
                continue  # this run's start as given; the checkpoint's scale is the state
            if same_value(value, SCALER_DEFAULTS[name]):
                self._given.pop(name, None)
            else:
                self._given[name] = value

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also write the scaler under stock ``MixedPrecision``'s key, so a stock run resumes at our scale."""
        if self.scaler is not None:
            checkpoint.setdefault(self._stock_key, self.scaler.state_dict())

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume a stock ``MixedPrecision`` run (no state of ours in the checkpoint) at its scale."""
        if type(self).__qualname__ in checkpoint:
            return  # ours: Lightning loads it through `load_state_dict`
        for key in (*_OUR_KEYS, *_STOCK_KEYS, "native_amp_scaling_state"):
            if key in checkpoint:
                self._engine.load_state_dict(checkpoint[key], where=f"checkpoint[{key!r}]")
                self._name_running_knobs()
                return


_MISSING = object()


def _name_the_islands(error: RuntimeError, added: list[str]) -> None:
    """On a dtype mismatch in the step, say that observation made islands, whose outputs stay float32."""
    text = str(error)
    if not ("Half" in text and "Float" in text) and "dtype" not in text:
        return
    note = (
        f"AmpPlusPrecision(auto_islands=True) runs {', '.join(repr(n) for n in added)} in float32, and an island's"
        " output stays float32: code that writes it into a float16 tensor (out[idx] = island(x), index_add_, scatter_)"
        " needs `.to(out.dtype)` there."
    )
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)


#: the key of the islands observation found, in the plugin's checkpoint state (``auto_islands=True``)
_AUTO_KEY = "auto_islands"
_SUMMARY_WARNING = r"Precision (16|bf16)-mixed is not supported by the model summary"


def _find_lightning_module(model: torch.nn.Module) -> Optional[pl.LightningModule]:
    for module in model.modules():
        if isinstance(module, pl.LightningModule):
            return module
    return None


#: the checkpoint keys of our Lightning plugins (each resumes the other's state) and of the stock ones
_OUR_KEYS = ("AmpPlusPrecision", "AmpPlusFSDPPrecision")
_STOCK_KEYS = ("FSDPPrecision", "MixedPrecision")


def logger_step(module: Optional[pl.LightningModule]) -> Optional[int]:
    """The step Lightning logs ``self.log`` values at during this batch (None outside a fit).

    One unit for every series of a run: an update is recorded, and the callbacks log, at this step. It counts
    batches that stepped an optimizer (a GAN's two optimizer steps share one; with ``accumulate_grad_batches`` it
    counts updates), not ``trainer.global_step``, which counts every optimizer's steps.
    """
    trainer = None if module is None else module._trainer
    return None if trainer is None else trainer.fit_loop.epoch_loop._batches_that_stepped
