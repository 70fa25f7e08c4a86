"""LossScaleMonitor: the exact loss-scale curve in every logger, at no per-step cost."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from typing_extensions import override

from lightning_amp_plus._log import say
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._series import value_at
from lightning_amp_plus._validation import check_bool, check_int, check_prefix
from lightning_amp_plus._warnings import warn_at_user
from lightning_amp_plus.advice import PLUGIN_HPARAM, plugin_call
from lightning_amp_plus.callbacks._common import (
    find_plugin,
    is_logging_step,
    log_to_all,
    logging_interval,
    next_logging_step,
    plugin_arguments,
)
from lightning_amp_plus.callbacks._state import DeclaredState
from lightning_amp_plus.precision import AmpPlusPrecision


class LossScaleMonitor(KnobsRepr, DeclaredState, Callback):
    """Log the loss scale and the skipped steps to every logger.

    At every logging point ``s`` (each ``logging_interval`` steps, and at the end of training) it logs, with ``step=``
    the step the logger uses for ``self.log`` in that batch (so every series of the run shares one x axis; one
    update per stepping batch, whatever the number of optimizers):

    * ``{prefix}loss_scale`` and ``{prefix}log2_loss_scale``: the scale step ``s`` used (before its update), and the
      same at every step in the interval where the scale changed, so the logged curve is the true step function;
    * ``{prefix}skipped_steps``: the cumulative count of skipped steps, also at every skipped step;
    * ``{prefix}skip_rate``: the fraction of optimizer-step cycles skipped since the previous logging point;
    * ``{prefix}growths`` and ``{prefix}backoffs``: cumulative counts of scale increases and decreases;
    * ``{prefix}applied_steps``: updates that changed the weights.

    At the start of each fit it logs the plugin's call (``AmpPlusPrecision("16-mixed", growth_interval=100)``) as
    the hyperparameter ``{prefix}plugin`` (``hparams.yaml`` of CSVLogger and TensorBoardLogger, MLflow's params, W&B's
    config), so ``lightning-amp-plus advise`` gives the run's own call with one change.

    With ``"bf16-mixed"`` there is no loss scale: the scale keys, growths and backoffs are not logged (a constant 1.0
    would read as a scale); the skipped steps, the skip rate and the applied updates are.

    The plugin records each step on the device; the record moves to the host once per logging interval (one
    host sync per interval, none on the other steps). With no logger the monitor warns once and the in-memory
    ``AmpPlusPrecision.history`` still holds everything. Only rank zero logs.

    With ``progress_bar=True`` the progress bar (TQDM or Rich) shows ``{prefix}scale`` and ``{prefix}skipped``,
    refreshed at the logging points (no host sync of its own). With Lightning's own ``MixedPrecision`` or
    ``FSDPPrecision`` (``precision="16-mixed"``) the monitor samples the scale at its logging points instead (one host
    read each; growths and backoffs inferred between samples; skipped steps unknown) and says so once.

    Args:
        logging_interval: steps between logging points; ``None`` uses ``Trainer(log_every_n_steps)``.
        prefix: the key prefix (default ``"amp/"``).
        progress_bar: show the scale and the skipped updates in the progress bar (default ``True``).

    Example:
        >>> from lightning_amp_plus import LossScaleMonitor
        >>> LossScaleMonitor(logging_interval=10).prefix
        'amp/'
    """

    def __init__(self, logging_interval: Optional[int] = None, prefix: str = "amp/", progress_bar: bool = True) -> None:
        self._given = given_arguments(LossScaleMonitor.__init__, locals())
        self._fit_scope = FitScope()
        owner = type(self).__name__
        if logging_interval is not None:
            check_int(owner, "logging_interval", logging_interval, minimum=1)
        self.logging_interval = logging_interval
        self.prefix = check_prefix(owner, prefix)
        self.progress_bar = check_bool(owner, "progress_bar", progress_bar)
        self._plugin: Optional[AmpPlusPrecision] = None  # set at setup, with the two below
        self._stock: Any = None  # Lightning's own MixedPrecision/FSDPPrecision: the curve is sampled
        self._interval = 50
        self._logged_call: Optional[str] = None  # the plugin call logged this fit
        self._next_log_after: Optional[int] = None
        self._next_log = 0
        self._bar: dict[str, str] = {}  # what the progress bar shows, refreshed at the logging points
        self._bar_owner: Any = None  # the progress bar whose `get_metrics` shows them
        # what was logged: a new fit resets it (`reset`), a resumed fit then loads its checkpoint
        self._logged_upto = self.add_state("logged_upto", -1)  # last step covered by a logging point
        self._growths = self.add_state("growths", 0)
        self._backoffs = self.add_state("backoffs", 0)
        self._skipped_logged = self.add_state("skipped_logged", 0)
        self._steps_logged = self.add_state("steps_logged", 0)  # recorded updates covered by earlier logging points
        # a stock plugin's scale at the last logging point
        self._last_sample: Optional[float] = self.add_state("last_sample", None, persistent=False)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._fit_scope.starts_afresh(trainer):
            self.reset()  # a new Trainer's fit starts afresh; a resumed one loads its checkpoint after this hook
        self._plugin = None
        self._stock = None
        self._interval = logging_interval(trainer, self.logging_interval)
        self._next_log_after = None  # `_logged_upto` when `_next_log` was computed
        plugin = trainer.strategy.precision_plugin
        if isinstance(plugin, (MixedPrecision, FSDPPrecision)) and not isinstance(plugin, AmpPlusPrecision):
            self._stock = plugin
            what = (
                "`amp/loss_scale` is sampled at the logging points (one host read each); growths and backoffs are"
                " inferred between samples, and skipped steps are not known"
                if plugin.scaler is not None
                else "it uses no loss scaler (bf16 or 32-bit), so there is no curve to log"
            )
            say(
                f"`LossScaleMonitor`: the trainer uses Lightning's {type(plugin).__name__}: {what}. HINT: for the exact"
                " curve and the skipped steps, use `Trainer(plugins=[AmpPlusPrecision('16-mixed')])` instead of"
                " `precision='16-mixed'`."
            )
        else:
            self._plugin = find_plugin(trainer, type(self).__name__)
        self._detach_bar()
        self._attach_bar(trainer)
        if not trainer.loggers and stage == "fit":  # it logs training only: validate and test are not told
            kept = (
                "the curve is kept in `AmpPlusPrecision.history` (`curve()`, `skipped_steps`, `to_csv()`)"
                if self._stock is None
                else "Lightning's own plugin keeps no curve (`AmpPlusPrecision` keeps it in `.history`)"
            )
            warn_at_user(f"`LossScaleMonitor`: the trainer has no logger, so nothing is logged; {kept}.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged_call = None
        if self._plugin is not None and trainer.is_global_zero:
            self._log_plugin_call(trainer, self._plugin)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a resumed fit restores the scaler's knobs after `on_fit_start`: the call that runs, where it changed
        resumed = getattr(trainer, "ckpt_path", None) is not None
        if (
            resumed
            and self._plugin is not None
            and trainer.is_global_zero
            and self._call(self._plugin) != self._logged_call
        ):
            self._log_plugin_call(trainer, self._plugin)

    def _call(self, plugin: AmpPlusPrecision) -> str:
        return plugin_call(type(plugin).__name__, plugin_arguments(plugin))

    def _log_plugin_call(self, trainer: pl.Trainer, plugin: AmpPlusPrecision) -> None:
        """The plugin's call as a hyperparameter, ``{prefix}plugin``: what ``advise`` repeats in its fixes.

        At fit start, before Lightning logs the module's own hyperparameters (and writes ``hparams.yaml``); again at
        train start where a checkpoint changed the knobs that run.
        """
        self._logged_call = self._call(plugin)
        params = {f"{self.prefix}{PLUGIN_HPARAM}": self._logged_call}
        for logger in trainer.loggers:
            try:
                if isinstance(logger, TensorBoardLogger):
                    # into hparams.yaml only: TensorBoard shows a run's first hparams summary, the module's own
                    logger.log_hyperparams(params, metrics={})
                else:
                    logger.log_hyperparams(params)
            except Exception as error:  # a logger that refuses it (MLflow: a changed value) does not stop the fit
                warn_at_user(f"`LossScaleMonitor`: {type(logger).__name__} did not take {params} ({error!r}).")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stock is not None:
            self._sample(trainer, pl_module)
            return
        assert self._plugin is not None
        last = self._plugin.history.last_step
        if last is None or last <= self._logged_upto:
            return
        if self._next_log_after != self._logged_upto:  # the next logging step, computed once per logging point
            self._next_log_after = self._logged_upto
            self._next_log = next_logging_step(self._logged_upto, self._interval)
        if last >= self._next_log:  # crossed Lightning's point
            self._log_until(trainer, last)
            history = self._plugin.history
            self._show(pl_module, history.scale_at(last) if history.scaled else None, float(self._skipped_logged))

    def _show(self, pl_module: pl.LightningModule, scale: Optional[float], skipped: Optional[float]) -> None:
        """The scale (and skipped updates) in Lightning's progress bar, refreshed at the logging points only.

        Shown as text (``2^21``, ``5``) through the bar's ``get_metrics``: ``self.log`` would print ``2097152.000``.
        """
        if scale is not None:
            exponent = math.log2(scale)
            self._bar[f"{self.prefix}scale"] = f"2^{exponent:.0f}" if exponent.is_integer() else f"{scale:.4g}"
        if skipped is not None:
            self._bar[f"{self.prefix}skipped"] = f"{skipped:.0f}"

    def _attach_bar(self, trainer: pl.Trainer) -> None:
        """Add this monitor's values to the progress bar's (its ``get_metrics``, Lightning's extension point)."""
        self._bar = {}
        bar = trainer.progress_bar_callback
        if not self.progress_bar or bar is None or "get_metrics" in vars(bar):
            return
        shown = bar.get_metrics

        def get_metrics(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
            return {**shown(trainer, pl_module), **self._bar}

        bar.get_metrics = get_metrics  # type: ignore[method-assign]
        self._bar_owner = bar

    def _detach_bar(self) -> None:
        bar, self._bar_owner = self._bar_owner, None
        if bar is not None and "get_metrics" in vars(bar):
            del bar.get_metrics

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach_bar()

    def _sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stock plugin: at each logging point, read the scale the next step will use (one host read)."""
        loop = trainer.fit_loop.epoch_loop
        # the next update's step, in the logger's unit: the counter moves after this hook when this batch stepped
        step = loop._batches_that_stepped + (0 if loop._should_accumulate() else 1)
        scaler = self._stock.scaler
        if scaler is None or step <= self._logged_upto or not is_logging_step(step, self._interval):
            return
        scale = float(scaler.get_scale())
        previous = self._last_sample
        if previous is not None and scale > previous:
            self._growths += 1  # at least one growth since the last sample
        elif previous is not None and scale < previous:
            self._backoffs += 1
        self._last_sample = scale
        log_to_all(trainer, self._metrics(scale=scale, counts=True), step)
        self._logged_upto = step
        self._show(pl_module, scale, None)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stock is not None:
            return
        assert self._plugin is not None
        last = self._plugin.history.last_step
        if last is not None and last > self._logged_upto:
            self._log_until(trainer, last)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # the state the run died in (a collapse: the scale at its floor) reaches the logger before it closes
        self._detach_bar()  # Lightning runs no `teardown` after an exception
        if self._stock is not None or self._plugin is None:
            return
        last = self._plugin.history.last_step
        try:
            if last is not None and last > self._logged_upto:
                self._log_until(trainer, last)
        except Exception as error:  # the fit's own exception is the one that propagates
            warn_at_user(f"`LossScaleMonitor`: the last state was not logged ({error!r}).")

    def _log_until(self, trainer: pl.Trainer, last: int) -> None:
        assert self._plugin is not None
        history = self._plugin.history
        scaled = history.scaled  # bf16-mixed: no loss scale exists; its skips, rate and applied updates are logged
        start = self._logged_upto + 1
        curve = history.curve() if scaled else []  # the one host transfer of this interval
        skipped = history.skipped_steps
        previous = value_at(curve, start - 1) if curve and curve[0][0] < start else None
        points: dict[int, dict[str, float]] = {}
        for step, scale in curve:
            if start <= step <= last:
                if previous is not None:  # change points: each differs from the one before
                    if scale > previous:
                        self._growths += 1
                    else:
                        self._backoffs += 1
                previous = scale
                points.setdefault(step, {}).update(self._metrics(scale=scale))
        count = self._skipped_logged
        window = [s for s in skipped if start <= s <= last]
        for step in window:
            count += 1
            points.setdefault(step, {}).update(self._metrics(skipped=count))
        self._skipped_logged = count
        # a rate over recorded cycles, not over the step range (a GAN's two optimizers record every other step)
        rate = len(window) / max(1, history.num_steps - self._steps_logged)
        self._steps_logged = history.num_steps
        last_scale = history.scale_at(last) if scaled else None
        applied = history.num_steps - len(skipped)
        points.setdefault(last, {}).update(self._metrics(last_scale, count, rate, applied, counts=scaled))
        for step in sorted(points):
            log_to_all(trainer, points[step], step)
        self._logged_upto = last

    def _metrics(
        self,
        scale: Optional[float] = None,
        skipped: Optional[int] = None,
        rate: Optional[float] = None,
        applied: Optional[int] = None,
        counts: bool = False,
    ) -> dict[str, float]:
        """The series logged at one step, by key: the one place a key is written (a figure not given is absent)."""
        figures = {
            "loss_scale": scale,
            "log2_loss_scale": None if scale is None else math.log2(scale),
            "skipped_steps": skipped,
            "skip_rate": rate,
            "growths": self._growths if counts else None,
            "backoffs": self._backoffs if counts else None,
            "applied_steps": applied,
        }
        return {self.prefix + key: float(value) for key, value in figures.items() if value is not None}
