"""AmpAdvisor: at the end of fit, what went wrong in the run and the one-line fix for each finding."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_amp_plus._log import say
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._validation import check_bool, check_path
from lightning_amp_plus._warnings import warn_at_user
from lightning_amp_plus.advice import Advice, RunFigures, advise, findings, healthy_line, hint_line, judged
from lightning_amp_plus.callbacks import _fused
from lightning_amp_plus.callbacks._common import (
    check_writable,
    find_plugin,
    log_to_all,
    run_figures,
    write_json_atomically,
    write_text_atomically,
)
from lightning_amp_plus.callbacks.grad_underflow_monitor import GradUnderflowMonitor
from lightning_amp_plus.callbacks.nan_skip_reporter import LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.callbacks.precision_report import PrecisionReport

#: batch ends left out of the run's step time (the first steps warm up)
_WARM_BATCHES = 2


class AmpAdvisor(KnobsRepr, Callback):
    """Tell the user, at the end of fit, what went wrong with mixed precision and the one-line fix.

    Added alone to a Trainer with ``AmpPlusPrecision``, it gathers what it needs: the plugin's scale history and
    settings, and the figures of :class:`GradUnderflowMonitor` (underflow and headroom), :class:`NaNSkipReporter`
    (each skip and where its non-finite values were born) and :class:`PrecisionReport` (what ran in float32). When
    the trainer has those callbacks their figures are read, never measured twice; the missing ones run inside the
    advisor, silent (no metric, line, warning or error of their own). At the end of fit, and when fit ends in an
    exception (``LossScaleCollapseError`` among them), it:

    * sets :attr:`advice`: :class:`~lightning_amp_plus.advice.Advice` objects (``code``, ``message``, ``fix``,
      ``evidence``), most important first (codes in :data:`~lightning_amp_plus.advice.CODES`);
    * prints them from rank zero (logger ``lightning_amp_plus``), or one line saying the run looks healthy, with its
      figures;
    * writes them to ``report_path`` (Markdown when it ends in ``.md``, JSON when ``.json``);
    * logs the count as ``amp/advice`` to every logger, and the text to TensorBoard (``amp/advice``).

    Speed hints (``fused_optimizer``, ``silent_fp32``) are kept apart in :attr:`hints`: one short line each, after
    the verdict. They never make a run unhealthy.

    It never runs your code again. The underflow monitor it runs has no float32 reference (add
    ``GradUnderflowMonitor(exact=True)`` yourself for one; the advisor reads yours). The reporter it runs observes
    (``find_origin=True``). A flagged layer's speed is measured on torch's own modules only. It costs what the
    callbacks it runs cost (the Performance page). :attr:`figures` keeps what the advice was computed from.

    Args:
        report_path: write the advice here at the end of fit (``.md`` or ``.json``); checked at setup.
        print_advice: print the advice (rank zero) at the end of fit (default True).

    Example:
        >>> from lightning_amp_plus import AmpAdvisor
        >>> AmpAdvisor(report_path="advice.md").advice
        []
    """

    def __init__(self, report_path: Optional[Union[str, os.PathLike]] = None, print_advice: bool = True) -> None:
        self._given = given_arguments(AmpAdvisor.__init__, locals())
        self._fit_scope = FitScope()
        owner = type(self).__name__
        self.report_path = check_path(owner, "report_path", report_path)
        if self.report_path is not None and not os.fspath(self.report_path).endswith((".md", ".json")):
            raise ValueError(
                f"`{owner}(report_path={os.fspath(self.report_path)!r})` is invalid: expected a path ending in .md"
                " (Markdown) or .json."
            )
        self.print_advice = check_bool(owner, "print_advice", print_advice)
        self.advice: list[Advice] = []  # health findings, most important first
        self.hints: list[Advice] = []  # speed hints (a fused optimizer, float32 work autocast would lower)
        self.figures: Optional[RunFigures] = None
        self._plugin: Any = None  # the attributes below are set at setup, before anything reads them
        self._underflow: Optional[GradUnderflowMonitor]
        self._reporter: Optional[NaNSkipReporter]
        self._report: Optional[PrecisionReport]
        self._own: list[Callback] = []  # the callbacks run inside the advisor (the trainer lacked them)
        self._advised: bool  # this fit's advice was given (at the end of training, or on its exception)
        self._clock = (0, 0.0, 0.0)  # batch ends seen, the time of the warm-up's last one, the time of the last

    # ------------------------------------------------------------------ wiring
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._plugin = find_plugin(trainer, type(self).__name__)
        self._advised = False
        self._clock = (0, 0.0, 0.0)
        if self._fit_scope.starts_afresh(trainer):
            self.advice, self.hints = [], []
            self.figures = None
            self._own = []  # a new Trainer's fit: fresh inner callbacks
        theirs = {type(c): c for c in trainer.callbacks if c is not self}  # type: ignore[attr-defined]
        self._underflow = _find(theirs, GradUnderflowMonitor)
        self._reporter = _find(theirs, NaNSkipReporter)
        self._report = _find(theirs, PrecisionReport)
        own: dict[type, Any] = {type(c): c for c in self._own}
        if self._underflow is None and self._plugin.scaler is not None:
            self._underflow = own.get(GradUnderflowMonitor)
            if self._underflow is None:
                self._underflow = GradUnderflowMonitor(max_warnings=0, quiet=True)
                self._underflow._first_too = True  # a fit shorter than log_every_n_steps is measured too
        if self._reporter is None:
            self._reporter = own.get(NaNSkipReporter) or NaNSkipReporter(
                max_consecutive_skips=None, max_warnings=0, max_records=None, quiet=True
            )
        if self._report is None:
            self._report = own.get(PrecisionReport) or PrecisionReport(print_table=False)
        self._own = [
            c for c in (self._underflow, self._reporter, self._report) if c is not None and c not in theirs.values()
        ]
        for callback in self._own:
            callback.setup(trainer, pl_module, stage)
        self._reporter.read_figures_from(trainer, lambda: self.gather(trainer, speed=False))
        if self.report_path is not None and trainer.is_global_zero:
            check_writable(type(self).__name__, "report_path", self.report_path)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in self._own:
            callback.on_fit_start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for callback in self._own:
            callback.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        for callback in self._own:
            callback.on_before_backward(trainer, pl_module, loss)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        count, first, _ = self._clock
        now = time.perf_counter()
        self._clock = (count + 1, now if count + 1 == _WARM_BATCHES else first, now)
        for callback in self._own:
            callback.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._finish(trainer)
        except LossScaleCollapseError:
            raise  # the reporter's own collapse check, which the user configured
        except Exception as error:  # advice never ends a fit that trained
            warn_at_user(f"`AmpAdvisor`: no advice for this fit ({error!r}).")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for callback in self._own:
            callback.teardown(trainer, pl_module, stage)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self._plugin is not None and not self._advised:
                self._finish(trainer, exception)  # a collapse is when the advice matters most
            elif self.figures is not None and self.figures.ended is None:  # it raised after the advice was given
                self.figures = dataclasses.replace(self.figures, ended=_ended(exception))
                if self.print_advice and not self.advice:
                    say(f"AmpAdvisor: {healthy_line(self.figures)}")
                if trainer.is_global_zero and self.report_path is not None:
                    self._write()
        except Exception as error:  # the fit's own exception is the one that propagates
            warn_at_user(f"`AmpAdvisor`: no advice after the failed fit ({error!r}).")
        finally:
            for callback in self._own:
                callback.on_exception(trainer, pl_module, exception)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The state of the callbacks the advisor runs inside (those the Trainer lacked), by class name."""
        return {type(c).__name__: c.state_dict() for c in self._own}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for callback in self._own:  # made at setup, which Lightning runs before it restores the callbacks
            if type(callback).__name__ in state_dict:
                callback.load_state_dict(state_dict[type(callback).__name__])

    # ------------------------------------------------------------------ advice
    def _finish(self, trainer: pl.Trainer, exception: Optional[BaseException] = None) -> None:
        self._advised = True
        if self._plugin.history.num_steps == 0:
            return  # nothing ran (a failed setup, max_steps=0): nothing to advise on
        if self._reporter is not None:  # theirs or ours: the skips a fused optimizer decided, whatever hook runs first
            self._reporter.collect(check=False)  # reported; the collapse check stays its own
        self.figures = self.gather(trainer)
        if exception is not None:
            self.figures = dataclasses.replace(self.figures, ended=_ended(exception))
        self.advice, self.hints = findings(advise(self.figures))
        text = self.format()
        if self.print_advice:
            say(text)
        step = self.figures.last_step
        assert step is not None  # an update was recorded
        log_to_all(trainer, {"amp/advice": float(len(self.advice))}, step)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
                if callable(add_text) and type(logger).__name__ == "TensorBoardLogger":
                    add_text("amp/advice", self.markdown(), global_step=step)
            if self.report_path is not None:
                self._write()

    def gather(self, trainer: pl.Trainer, speed: bool = True) -> RunFigures:
        """The run's figures, from the plugin and the callbacks (see :class:`~lightning_amp_plus.advice.RunFigures`).

        The one place a live run's figures are built: the reporter's collapse check reads them too.
        ``speed=False`` leaves out what only the speed hints read (the float32 rows, the timed optimizer steps).
        """
        assert self._reporter is not None  # theirs, or run inside since setup
        assert self._report is not None
        scaler = self._plugin.scaler
        underflow = self._underflow.measurements if self._underflow is not None and scaler is not None else None
        rows = None if not speed or self._report.skipped_reason else [r for r in self._report.rows if r["flagged"]]
        return run_figures(
            self._plugin,
            self._reporter.origins_told,
            underflow=list(underflow) if underflow is not None else None,
            fp32_rows=rows,
            non_fused=self._non_fused(trainer) if speed else None,
        )

    def _non_fused(self, trainer: pl.Trainer) -> list[dict[str, Any]]:
        """Torch optimizers that could run fused on their device and do not, with their steps timed both ways."""
        step_ms = self._step_ms()
        found = []
        for optimizer, entry in _fused.candidates(trainer.optimizers, trainer.lightning_module):
            times = _fused.step_times(optimizer)
            if times is not None:
                entry.update(times, train_step_ms=step_ms)
            found.append(entry)
        return found

    def _step_ms(self) -> Optional[float]:
        """The run's mean step time, between batch ends after the first two (None: too few batches)."""
        count, first, last = self._clock
        return None if count <= _WARM_BATCHES else 1e3 * (last - first) / (count - _WARM_BATCHES)

    def format(self) -> str:
        """The console text: the findings, most important first, or the healthy line; then one line a speed hint."""
        assert self.figures is not None
        if not self.advice:
            lines = [f"AmpAdvisor: {healthy_line(self.figures)}"]
        else:
            count = f"{len(self.advice)} finding{'s' if len(self.advice) != 1 else ''}"
            lines = [f"AmpAdvisor: {count}, most important first:"]
            lines.extend(f"{i}. {a}" for i, a in enumerate(self.advice, start=1))
        return "\n".join([*lines, *map(hint_line, self.hints)])

    def markdown(self) -> str:
        """The advice as Markdown (the ``.md`` report and TensorBoard's text)."""
        assert self.figures is not None
        out = ["# AmpAdvisor", ""]
        if not self.advice:
            out.append(healthy_line(self.figures)[0].upper() + healthy_line(self.figures)[1:])
        for a in self.advice:
            out += [f"## `{a.code}`", "", a.message, "", "```python", a.fix, "```", ""]
            out.append("Evidence: " + ", ".join(f"`{k}`: {v}" for k, v in a.evidence.items()))
            out.append("")
        if self.hints:
            out += ["", "## Speed hints", ""]
            out += [f"- `{a.code}`: {a.message} Fix: `{'; '.join(a.fix.splitlines())}`" for a in self.hints]
        return "\n".join(out).rstrip() + "\n"

    def _write(self) -> None:
        assert self.report_path is not None
        assert self.figures is not None
        path = os.fspath(self.report_path)
        try:
            if path.endswith(".json"):
                write_json_atomically(
                    path,
                    {
                        "healthy": not self.advice and judged(self.figures),
                        "summary": healthy_line(self.figures) if not self.advice else None,
                        "advice": [a.to_dict() for a in self.advice],
                        "speed": [a.to_dict() for a in self.hints],
                    },
                )
            else:
                write_text_atomically(path, self.markdown())
        except OSError as error:
            warn_at_user(f"`AmpAdvisor`: could not write {path!r}: {error}.")


def _ended(exception: BaseException) -> str:
    """How a fit ended, in a line: ``AssertionError: bad batch`` (120 characters at most)."""
    said = f"{type(exception).__name__}: {exception}".splitlines()[0] if str(exception) else type(exception).__name__
    return said if len(said) <= 120 else said[:117] + "..."


def _find(callbacks: dict[type, Callback], kind: type) -> Any:
    for cls, callback in callbacks.items():
        if issubclass(cls, kind):
            return callback
    return None
