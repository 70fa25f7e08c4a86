"""NaNSkipReporter: every skipped step reported with the parameters that overflowed; a clear error on collapse."""

from __future__ import annotations

import bisect
import functools
import math
import os
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._limits import scale_floor
from lightning_amp_plus._log import say
from lightning_amp_plus._ranks import all_reduce_, distributed
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._validation import check_bool, check_int, check_path, check_prefix
from lightning_amp_plus._warnings import warn_at_user
from lightning_amp_plus.advice import RunFigures, collapse_advice
from lightning_amp_plus.callbacks._common import (
    check_writable,
    find_plugin,
    is_logging_step,
    log_to_all,
    logging_interval,
    run_figures,
    shards_gradients,
    write_json_atomically,
)
from lightning_amp_plus.callbacks._device_probe import DeviceSkipProbe
from lightning_amp_plus.callbacks._offenders import OffenderCounter
from lightning_amp_plus.callbacks._skip_text import collapse_message, describe, enough, skip_record, summary
from lightning_amp_plus.callbacks._state import DeclaredState
from lightning_amp_plus.engine import EngineView, SkipEvent, UpdateListener
from lightning_amp_plus.forensics.finder import OriginFinder
from lightning_amp_plus.forensics.observe import BatchRecord
from lightning_amp_plus.forensics.origin import EARLIER_MICRO_BATCH, Origin, Phase
from lightning_amp_plus.forensics.verdict import job_origin, joins_also


class LossScaleCollapseError(RuntimeError):
    """Training stopped: too many optimizer steps in a row were skipped, or the scale overflowed at ``min_scale``."""


class NaNSkipReporter(KnobsRepr, DeclaredState, UpdateListener, Callback):
    """Report every skipped optimizer step: when, what the scale did, and which parameters overflowed.

    Each skipped update (one loss-scale cycle: every optimizer step of a batch; ``step`` is the step the logger uses
    for ``self.log`` in that batch, so the skips share the x axis of every other metric) gives a record with ``step``,
    ``scale`` (the scale the step used), ``new_scale``, ``loss`` (when finite), ``offenders``: ``[{"name", "inf",
    "nan"}]`` for every parameter whose gradient held non-finite values, named as in ``named_parameters()``, and
    ``origin``: where the non-finite values were born. The first ``max_warnings`` skips are printed (rank zero, logger
    ``lightning_amp_plus``), e.g. ``step 412 skipped: gradients non-finite in encoder.ff.weight (12 inf), loss scale
    65536 -> 32768``; later ones are counted and summarised at the end of fit, and written to ``report_path`` as JSON
    when given. :attr:`skips` keeps the first and last ``max_records // 2`` records in full; every skip is still
    counted (:attr:`num_skips`, :attr:`skipped_steps`, the offenders' counts). The counters and records go into the
    checkpoint, so a resumed run continues a streak of skips where it stopped.

    The offenders are counted on skipped steps only. A fused optimizer decides on the device: its flag is copied
    without waiting and read when it is on the host (at once on CPU, by the next batch's start on a GPU), and on a
    skip the offenders are counted from the gradients it left and the origin told; the skip is reported then (and its
    collapse raised), or at the next logging step for a flag read no earlier. ``sync_fused=True`` reads each flag at
    its step instead.

    The ``origin`` (Trainer only) says where the inf/nan were born: the batch, a module's forward, the LightningModule's
    own code, the loss or backward. It is observed: nothing of yours runs again. After the first skip whose loss held
    inf/nan, every module is watched (a forward hook each, read only on a skipped step), so the next such skip names
    the module. ``find_origin="watch"`` watches from the start; ``"replay"`` also runs the module's call again, in a
    sandbox, to measure the float32 verdict and the islands a fix needs (opt-in: anything its code does outside the
    model's parameters, buffers and random streams happens again). ``None`` when it cannot be told: a fused
    optimizer's skip whose flag reached the host too late (``sync_fused=True`` tells it), Fabric.

    Args:
        max_consecutive_skips: raise :class:`LossScaleCollapseError` after this many skipped steps in a row
            (default 25; ``None`` disables). A step that overflows while the scale sits at ``min_scale`` raises too.
        report_path: write the skip report as JSON here at the end of fit (and on collapse), atomically (a temporary
            file renamed into place). Checked at setup: its folder must be writable. A failed write never hides a
            training error.
        max_warnings: skips printed one by one before the rest are only summarised (default 5).
        sync_fused: read a fused optimizer's skip flag at its step, so its skip is told at once (one host sync per
            step; default False: read without waiting, told once it is on the host, or at the next logging step).
        prefix: key prefix of the logged metrics (default ``"amp/"``).
        max_records: skip records kept in full (the first and the last half; default 100; ``None`` keeps all).
        find_origin: where each skip's inf/nan were born: True (observe; the default), ``"watch"`` (watch every
            module from the start), ``"replay"`` (also run the module's call again to measure), False (none).
        backward_origin: run a skipped batch's ``training_step`` again, sandboxed, to tell what no watch reads:
            where in backward (op, module) inf/nan were born, or whether float32 makes them too in backward or in
            the LightningModule's own code (default False: it runs your step twice; automatic optimization only).
        quiet: records only: no metric, line, error or file (for a callback that holds this one, as ``AmpAdvisor``).

    Example:
        >>> from lightning_amp_plus import NaNSkipReporter
        >>> NaNSkipReporter(max_consecutive_skips=10).skips
        []
    """

    def __init__(
        self,
        max_consecutive_skips: Optional[int] = 25,
        report_path: Optional[Union[str, os.PathLike]] = None,
        max_warnings: int = 5,
        sync_fused: bool = False,
        prefix: str = "amp/",
        max_records: Optional[int] = 100,
        find_origin: Union[bool, Literal["watch", "replay"]] = True,
        quiet: bool = False,
        backward_origin: bool = False,
    ) -> None:
        self._given = given_arguments(NaNSkipReporter.__init__, locals())
        self._fit_scope = FitScope()
        owner = type(self).__name__
        if max_consecutive_skips is not None:
            check_int(owner, "max_consecutive_skips", max_consecutive_skips, minimum=1)
        check_int(owner, "max_warnings", max_warnings, minimum=0)
        check_bool(owner, "sync_fused", sync_fused)
        if max_records is not None:
            check_int(owner, "max_records", max_records, minimum=2)
        self.max_consecutive_skips = max_consecutive_skips
        self.report_path = check_path(owner, "report_path", report_path)
        self.max_warnings = max_warnings
        self.sync_fused = sync_fused
        self.prefix = check_prefix(owner, prefix)
        self.max_records = max_records
        if not isinstance(find_origin, (bool, str)) or find_origin not in (True, False, "watch", "replay"):
            raise ValueError(
                f'`{owner}(find_origin={find_origin!r})` is invalid: expected True (observe, the default), "watch"'
                ' (watch every module from the start), "replay" (also measure, running the module again) or False.'
            )
        self.find_origin = find_origin
        self.quiet = check_bool(owner, "quiet", quiet)
        self.backward_origin = check_bool(owner, "backward_origin", backward_origin)
        self._rerun = False  # this fit reruns a skipped step for its backward origin
        # where each skip's inf/nan were born: watched after the first forward-born skip, or from the start
        self.origins = OriginFinder(watch=find_origin == "watch", replay=find_origin == "replay")
        self._plugin: Optional[EngineView] = None
        self._trainer: Optional[pl.Trainer] = None
        self._figures_source: Optional[tuple[Any, Callable[[], RunFigures]]] = None  # (the fit's trainer, builder)
        self.offenders = OffenderCounter()  # the parameters whose gradients held inf/nan, per skipped update
        self._sharded = False
        self._loss: Optional[Tensor] = None
        # with gradient accumulation (`Trainer(accumulate_grad_batches)`: an earlier micro-batch's inf/nan are the
        # update's too), the window's micro-batches, in order: (the id of the live record, what is kept of it: its
        # loss and the watch's trace, not its batch), and the window before (a fused skip's flag read late)
        self._accumulate, self._accumulating = 1, False  # an attribute, not a property: read every step
        self._window: list[tuple[int, BatchRecord]] = []
        self._last_window: list[tuple[int, BatchRecord]] = []
        # the skips reported: a new fit resets them (`reset`), a resumed fit then loads its checkpoint
        tail = None if max_records is None else max_records - max_records // 2
        self._head: list[dict[str, Any]] = self.add_state("head", list, load=list)
        self._tail: deque[dict[str, Any]] = self.add_state(
            "tail", functools.partial(deque, maxlen=tail), save=list, load=functools.partial(deque, maxlen=tail)
        )
        self._num_skips = self.add_state("num_skips", 0)
        # every skip's origin with its step, records dropped from `skips` included: what the advice reads
        self._origins_told: list[dict[str, Any]] = self.add_state("origins_told", list, load=list)
        self._skipped_steps: list[int] = self.add_state("skipped_steps", list, load=_ints)
        self._offender_counts: Counter[str] = self.add_state("offender_counts", Counter, save=dict, load=Counter)
        self._consecutive = self.add_state("consecutive", 0)
        self._reported_upto = self.add_state("reported_upto", -1)
        self._warned = self.add_state("warned", 0)
        self._watching = self.add_state("watching", False)  # a resumed fit watches where the first one did
        # per fit only
        self._device_probe: DeviceSkipProbe = self.add_state("device_probe", DeviceSkipProbe, persistent=False)
        # skips collected for AmpAdvisor, checked for a collapse at finish
        self._unchecked: list[tuple[dict[str, Any], int]] = self.add_state("unchecked", list, persistent=False)

    # ------------------------------------------------------------------ wiring
    @property
    def skips(self) -> list[dict[str, Any]]:
        """The skip records kept in full (all of them up to ``max_records``; then the first and the last half)."""
        return [*self._head, *self._tail]

    @property
    def origins_told(self) -> list[dict[str, Any]]:
        """Every skip's origin that was told, with its ``step`` (records dropped from :attr:`skips` included)."""
        return list(self._origins_told)

    @property
    def num_skips(self) -> int:
        """Every skipped update reported so far (records dropped from :attr:`skips` included)."""
        return self._num_skips

    @property
    def skipped_steps(self) -> list[int]:
        """The step of every skipped update reported so far."""
        return list(self._skipped_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._fit_scope.starts_afresh(trainer):
            self.reset()  # a new Trainer's fit starts afresh; a resumed one loads its checkpoint after this hook
        self.attach(find_plugin(trainer, type(self).__name__), pl_module, trainer)
        if self.report_path is not None and trainer.is_global_zero and not self.quiet:
            check_writable(type(self).__name__, "report_path", self.report_path)

    def attach(self, plugin: EngineView, module: torch.nn.Module, trainer: Optional[pl.Trainer] = None) -> None:
        """Report the skips of ``plugin`` for ``module`` (the Trainer calls it at setup).

        With Fabric call it yourself after ``fabric.setup``, and :meth:`finish` at the end (summary and JSON report).
        """
        self._plugin = plugin
        self._trainer = trainer
        self.offenders.track(module, sharded=False)
        plugin.listen(self)
        plugin.listen(self.origins)  # the batch as its step starts

    def read_figures_from(self, trainer: pl.Trainer, source: Callable[[], RunFigures]) -> None:
        """Build the collapse's figures with ``source`` during ``trainer``'s fit.

        :class:`~lightning_amp_plus.AmpAdvisor` hands its own builder here at setup, so the collapse's HINT reads
        the figures the advisor reads (its measurements too): the error and the advice never disagree. Another
        trainer's fit does not use it.
        """
        self._figures_source = (trainer, source)

    def detach(self) -> None:
        """Stop listening to the plugin."""
        if self._plugin is not None:
            self._plugin.unlisten(self)
            self._plugin.unlisten(self.origins)
        self.offenders.clear()

    @property
    def needs_host_skips(self) -> bool:  # type: ignore[override]
        """``sync_fused=True``: a fused optimizer's skip is read at its step (one host sync a step)."""
        return self.sync_fused

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()
        self._unhook()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self._plugin is not None:  # skips a fused optimizer decided: reported, never raised over the error
                self._device_probe.look(self._read_device_skip, wait=True)
                self._collect_device_skips(check=False)
        finally:
            self._unchecked = []
            self.detach()  # Lightning skips `teardown` after an exception: a retry must not meet this reporter
            self._unhook()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the parameters as trained: FSDP2's `fully_shard` (in `configure_model`, after `setup`) replaces them
        self._sharded = shards_gradients(trainer)
        self.offenders.track(pl_module, self._sharded)
        self._unhook()
        self._rerun = False
        self._accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        self._accumulating = self._accumulate > 1
        self._window, self._last_window = [], []
        if self.find_origin:
            accumulating = self._accumulating
            # a rerun of the step: only where one batch's step makes the update and steps no optimizer itself
            self._rerun = self.backward_origin and pl_module.automatic_optimization and not accumulating
            plugin = self._plugin
            said = self.origins.attach(
                pl_module,
                trainer.precision_plugin.forward_context,
                islands=functools.partial(_island_names, plugin),
                accumulating=accumulating,
                sharded=self._sharded,
                rerun=self._rerun,
            )
            self._say(said or (self.origins.start_watching() if self._watching else None))  # a resumed fit's
            if self._rerun and trainer.is_global_zero and not self.quiet:
                from lightning_amp_plus.forensics.opt_in.rerun import announce  # backward_origin=True, by name

                announce(
                    "NaNSkipReporter(backward_origin=True)",
                    "on a skipped update born in backward or in the LightningModule's own code,",
                )
            if self.origins.replay and trainer.is_global_zero and not self.quiet:
                say(
                    '`NaNSkipReporter(find_origin="replay")`: on a skip born in a module, that module\'s call runs'
                    " again, in a sandbox: parameters, buffers and random streams are put back; anything else its code"
                    " does happens again."
                )

    # ------------------------------------------------------------------ where non-finite values are born
    def _unhook(self) -> None:
        self.origins.detach()
        self._device_probe.drop()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._device_probe.held is not None:  # the previous batch's fused skip: its parameters are unchanged
            self._look()
        if self.find_origin:  # begun as its step starts (the plugin tells the finder)
            self.origins.current = BatchRecord(batch, batch_idx)
        if self._accumulating and batch_idx % self._accumulate == 0:  # Lightning's window starts (an epoch's too)
            self._last_window, self._window = self._window, []

    def _say(self, line: Optional[str]) -> None:
        if line is not None and not self.quiet:
            say(f"`NaNSkipReporter`: {line}")

    def _watch_if_asked(self, origin: Optional[Origin]) -> None:
        """Start the watch where this skip's origin asks for it (the job's, over every rank)."""
        if self.find_origin:
            self._say(self.origins.watch_if_asked(origin))
            self._watching = self.origins.watching

    def _origin(
        self, calls: Optional[BatchRecord] = None, step: Optional[int] = None, scale: Optional[float] = None
    ) -> Optional[Origin]:
        """Where a batch's (default: this one's) non-finite values were born; None when it cannot be told.

        With ``backward_origin``, what no replay reads (where in backward, an own-code origin's float32 verdict) is
        told by a sandboxed rerun of the step at the update's ``scale`` (or the scale the update at ``step`` used).
        """
        if not self.find_origin or self._trainer is None:
            return None
        origin = self.origins.origin(calls)
        if not self._rerun or self._plugin is None or origin is None:
            return origin
        if scale is None and step is not None:
            scale = self._plugin.history.scale_at(step)
        record = calls if calls is not None else self.origins.current
        device = getattr(self._plugin, "device", None) or "cpu"
        before = self.origins.called_before(record) if record is not None else []
        from lightning_amp_plus.forensics.opt_in.rerun import origin_by_rerun  # backward_origin=True: loaded

        return origin_by_rerun(origin, record, self._trainer, device, scale, before)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._loss = loss  # the true loss (the plugin scales after this hook); read (detached) only on skips
        current = self.origins.current
        if self._accumulating:  # each micro-batch's, until its window ends
            self._window.append((id(current), self._kept_of(current, loss)))
        if current is not None:  # a GAN's batch backpropagates two
            current.losses.append(loss)

    def _kept_of(self, record: Optional[BatchRecord], loss: Tensor) -> BatchRecord:
        """A micro-batch as kept until its update ends: its loss and the watch's trace of it, not its batch.

        A few numbers a module call, read only on a skip: memory does not grow with the batch's size.
        """
        kept = BatchRecord(None, record.index if record is not None else -1, losses=[loss])
        if record is not None and record.trace is not None:
            kept.trace, kept.unread = record.trace, self.origins.watch.unread
        return kept

    # ------------------------------------------------------------------ host-known skips
    @override
    def update_skipped(self, event: SkipEvent) -> None:
        assert self._plugin is not None
        # skips a fused optimizer decided before this one come first (the history is on the host already)
        self._collect_device_skips(upto=event.step - 1)
        window = self._earlier(self.origins.current)
        bad = self._nonfinite(window)
        loss = bad[0].losses[0] if bad else self._mean_loss()
        told = self._skip_facts(None, event.optimizers, loss, scale=event.scale)
        self._told_earlier(told, window, bad)
        told["origin"] = self._job_origin(told["origin"])
        self._watch_if_asked(told["origin"])
        self.offenders.clear()
        scaled = self._plugin.scaler is not None
        self._add(skip_record(event.step, event.scale, event.new_scale, told, scaled), event.consecutive)

    def _job_origin(self, origin: Optional[Origin]) -> Optional[Origin]:
        """The update's origin over every rank (each skips it, so each calls this): the rank that saw it born tells."""
        if not self.find_origin or not distributed():
            return origin
        gathered: list[Optional[Origin]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, origin)  # on skipped updates only
        return job_origin(gathered)

    @override
    def skipped_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.offenders.at_skipped_step(optimizer)

    def _earlier(self, record: Optional[BatchRecord]) -> Optional[list[BatchRecord]]:
        """The micro-batches of ``record``'s window before it (``record``: the one that stepped); None: not told.

        Its window is this one or, for a fused skip's flag read after the next window began, the one before. Under
        DDP each rank's differ: only the last micro-batch is told (documented).
        """
        if not self._accumulating or record is None or distributed():
            return None
        for window in (self._window, self._last_window):
            at = [i for i, (key, _) in enumerate(window) if key == id(record)]
            if at:
                return [kept for _, kept in window[: at[0]]]
        return None

    @staticmethod
    def _nonfinite(earlier: Optional[list[BatchRecord]]) -> list[BatchRecord]:
        """The earlier micro-batches whose loss held inf/nan (one host read each, on a skip only)."""
        with torch.no_grad():
            return [kept for kept in earlier or [] if not bool(torch.isfinite(kept.losses[0]).all())]

    def _told_earlier(self, told: dict[str, Any], window: Optional[list[BatchRecord]], bad: list[BatchRecord]) -> None:
        """An earlier micro-batch's loss held inf/nan: the modules the watch saw them born in there join the origin.

        The last micro-batch's named module keeps its place and the earlier ones join its ``also``; where it named
        none (its loss finite), the first earlier one is the origin. Where no module was named there (not watched
        yet, or the batch or your code, which a micro-batch kept without its batch cannot tell apart): born before
        backward, in an earlier micro-batch. Never "backward", which says the loss was finite; every micro-batch's
        loss finite: backward. A module joins ``also`` by its rule (``+inf``; a NaN there may be the model's own).
        """
        origin = told["origin"]
        if window is None or not self.find_origin:
            return
        if not bad:  # every micro-batch's loss was finite: born in backward, as without accumulation
            told["origin"] = origin if origin is not None else Origin(Phase.BACKWARD)
            return
        # where the watch saw them born in those micro-batches (each read without its batch)
        told_there = (self.origins.origin(kept) for kept in bad if kept.trace is not None)
        named = [o for o in told_there if o is not None and o.phase is Phase.FORWARD and o.name]
        if origin is None or origin.phase in (Phase.BACKWARD, Phase.UNKNOWN):  # the last micro-batch's was finite
            if not named:
                kind = "nan" if told["loss"] == "nan" else "inf"
                told["origin"] = Origin(Phase.FORWARD, kind=kind, reason=EARLIER_MICRO_BATCH)
                return
            origin, named = named[0], named[1:]
        joins = [o for o in named if joins_also(o)]
        if joins and origin.phase is Phase.FORWARD and origin.name:
            also = [n for o in joins for n in (o.name, *o.also) if n != origin.name]
            origin = origin.replace(also=tuple(dict.fromkeys((*origin.also, *also))))
        told["origin"] = origin

    def _mean_loss(self) -> Optional[Tensor]:
        """The loss, averaged over ranks when several train (every rank skips the same steps, so all call this)."""
        if self._loss is None or not distributed():
            return self._loss
        loss = self._loss.detach().float().mean().reshape(1).clone()
        return all_reduce_(loss) / torch.distributed.get_world_size()

    # ------------------------------------------------------------------ device-decided skips (fused optimizers)
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._plugin is not None
        if self.find_origin:
            self.origins.take_batch()  # the batch is released when it ends (or kept by the probe, just below)
        if self._plugin.skip_known_on_host:
            return
        history = self._plugin.history
        if not self._sharded:
            self._device_probe.hold(history, self.origins.last)  # kept until its flag is read
            self._look()  # at once when it is (host memory, or the device is done)
        if is_logging_step(history.last_step or 0, logging_interval(trainer)):
            self._collect_device_skips(updated=True)  # another callback may have flushed the history: not `pending`
            self._check_unchecked()  # skips a checkpoint collected in between are checked where they would have been

    def _look(self) -> None:
        """Read the held flag if it is on the host (no wait); a skip it shows is reported and checked at once.

        As a skip the host knew at its step is: its collapse stops the fit here, not at the next logging step (the
        history is flushed on a skip read only).
        """
        step = self._device_probe.look(self._read_device_skip, wait=False)
        if step is not None:
            self._collect_device_skips(upto=step, updated=True)

    def _read_device_skip(self, calls: Optional[BatchRecord], step: int) -> dict[str, Any]:
        """A device-decided skip, once its flag is read: its origin and its offenders, from the gradients it left.

        They are still the skipped step's: it is read at this batch's end or before the next batch's backward.
        """
        optimizers = [resolve_optimizer(o) for o in self._trainer.optimizers] if self._trainer is not None else []
        loss = self._loss if calls is None or not calls.losses else calls.losses[-1]  # this rank's
        window = self._earlier(calls)  # its own window's, even where the flag is read after the next one began
        bad = self._nonfinite(window)
        told = self._skip_facts(calls, optimizers, bad[0].losses[0] if bad else loss, step=step)
        self._told_earlier(told, window, bad)
        told["offenders"] = told["offenders"] or None
        self._watch_if_asked(told["origin"])
        return told

    def _skip_facts(
        self,
        calls: Optional[BatchRecord],
        optimizers: list[Any],
        loss: Optional[Tensor],
        step: Optional[int] = None,
        scale: Optional[float] = None,
    ) -> dict[str, Any]:
        """What a skip's record tells beyond its step and scales: its loss, offenders and origin."""
        origin = self._origin(calls, step, scale)
        return {"loss": _loss_value(loss), "offenders": self.offenders.of(optimizers), "origin": origin}

    def collect(self, check: bool = True) -> None:
        """Report now every skip a fused optimizer decided on the device (waits for a held flag: one sync at most).

        ``check=False`` leaves their collapse check to this reporter's own end of fit (a reader that is not the
        reporter, ``AmpAdvisor``, must not raise in its place).
        """
        self._device_probe.look(self._read_device_skip, wait=True)
        self._collect_device_skips(check=check, updated=True)

    def _collect_device_skips(self, upto: Optional[int] = None, check: bool = True, updated: bool = False) -> None:
        """Report the skips in the history not reported yet (decided on the device), up to ``upto`` (default: all).

        ``updated``: the last recorded step's update is done, so its new scale is the scaler's (one read, only when
        that step was skipped: its line says what the skip did to the scale).
        """
        assert self._plugin is not None
        scaler = self._plugin.scaler
        scale_now = scaler.get_scale if updated and scaler is not None else None
        found, last = self._device_probe.records(
            self._plugin.history, self._reported_upto, set(self._skipped_steps), upto, scale_now, scaler is not None
        )
        for record, streak in found:  # all kept before any is checked: a collapse among them drops none of the rest
            self._add(record, streak, check=False)
        self._reported_upto = last
        if check:
            self._check_unchecked()

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, record: dict[str, Any], consecutive: int, check: bool = True) -> None:
        """Keep, log and print one skip; ``consecutive`` is the history's count of skipped updates in a row."""
        assert self._plugin is not None
        self._consecutive = consecutive
        self._keep(record)
        if self.quiet:
            return
        if self._trainer is not None:
            metrics = {"step_skipped": 1.0, "consecutive_skips": float(self._consecutive)}
            if record.get("loss") is not None:  # read: whether the loss was inf/nan before scaling (offline `advise`)
                metrics["skip_loss_nonfinite"] = float(isinstance(record["loss"], str))
            log_to_all(self._trainer, {self.prefix + key: value for key, value in metrics.items()}, record["step"])
        if self._warned < self.max_warnings:
            self._warned += 1
            scaler = self._plugin.scaler
            backoff_on = getattr(self._plugin, "backoff_on", "any")
            say(describe(record, getattr(scaler, "hysteresis", 1), getattr(scaler, "min_scale", 0.0), backoff_on))
            if self._warned == self.max_warnings:
                say(enough(self.max_warnings))
        if check:
            self._check_collapse(record)
        else:
            self._unchecked.append((record, consecutive))

    def _check_unchecked(self) -> None:
        """The collapse check of skips collected without it (by ``AmpAdvisor`` before this reporter's own finish)."""
        unchecked, self._unchecked = self._unchecked, []
        for record, consecutive in unchecked:
            self._consecutive = consecutive
            self._check_collapse(record)

    def _check_collapse(self, record: dict[str, Any]) -> None:
        assert self._plugin is not None
        scaler = self._plugin.scaler
        at_floor = scaler is not None and record["scale"] <= scale_floor(scaler.knobs()["min_scale"])
        limit = self.max_consecutive_skips
        if not at_floor and (limit is None or self._consecutive < limit):
            return
        source = self._figures_source
        if source is not None and source[0] is self._trainer:  # the advisor's figures: one diagnosis, said alike
            figures = source[1]()
        else:
            figures = run_figures(self._plugin, self._origins_told)
        min_scale = scaler.knobs()["min_scale"] if at_floor and scaler is not None else None
        batch = sum(1 for origin in self._origins_told if origin["phase"] == "input")
        cause = collapse_advice(figures)
        message = collapse_message(record, self._consecutive, limit, min_scale, cause, (batch, self._num_skips))
        # the fit stops here: a fused optimizer's skip still unreported (its flag in flight) goes in the report too
        self._device_probe.look(self._read_device_skip, wait=True)
        self._collect_device_skips(check=False, updated=True)
        try:
            self._write_report()
        except OSError as error:  # the collapse is the error that matters
            message += f" (The skip report could not be written to {os.fspath(self.report_path)!r}: {error}.)"
        raise LossScaleCollapseError(message)

    # ------------------------------------------------------------------ summary and report
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()

    def finish(self) -> None:
        """Collect the skips a fused optimizer decided on the device, say a summary, write the JSON report."""
        self._device_probe.look(self._read_device_skip, wait=True)
        self._collect_device_skips(updated=True)
        self._check_unchecked()
        if self.quiet:  # records only
            return
        if self._num_skips:
            say(summary(self.report()))
        try:
            self._write_report()
        except OSError as error:
            warn_at_user(
                f"`NaNSkipReporter`: could not write the skip report to {os.fspath(self.report_path)!r}: {error}."
            )

    def report(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: counts, skipped steps, every record and the worst offenders."""
        history = self._plugin.history if self._plugin is not None else None
        return {
            "unit": "update: one loss-scale cycle (every optimizer step of one batch); steps are the logger's step",
            "num_steps": history.num_steps if history is not None else None,
            "num_skipped": self._num_skips,
            "skipped_steps": list(self._skipped_steps),
            "worst_offenders": [{"name": n, "skips": c} for n, c in self._offender_counts.most_common()],
            "records_dropped": self._num_skips - len(self._head) - len(self._tail),
            "skips": self.skips,
        }

    def _keep(self, record: dict[str, Any]) -> None:
        self._num_skips += 1
        bisect.insort(self._skipped_steps, record["step"])
        if record.get("origin"):
            self._origins_told.append({**record["origin"], "step": record["step"]})
        for offender in record["offenders"] or []:
            self._offender_counts[offender["name"]] += 1
        if self.max_records is None or len(self._head) < self.max_records // 2:
            self._head.append(record)
        else:
            self._tail.append(record)

    def _write_report(self) -> None:
        """Write the JSON report atomically (rank zero); raises ``OSError`` when the file system refuses."""
        if self.report_path is None or (self._trainer is not None and not self._trainer.is_global_zero):
            return
        write_json_atomically(self.report_path, self.report())

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._plugin is not None:  # a fused optimizer's skips still on the device: saved with their origins
            self.collect(check=False)
        return {"version": 3, **super().state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "version" not in state_dict:  # 0.1.0: the records only
            old = state_dict
            self.reset()
            for record in old.get("skips", []):
                self._keep(record)
            state_dict = {
                **self.state_dict(),
                "consecutive": old.get("consecutive", 0),
                "reported_upto": old.get("reported_upto", -1),
            }
        super().load_state_dict(state_dict)
        if "origins_told" not in state_dict:  # 0.3's: the origins of the records it kept
            self._origins_told = [{**r["origin"], "step": r["step"]} for r in self.skips if r.get("origin")]


def _island_names(plugin: Any) -> list[str]:
    """The islands the skipped step ran with (``auto_islands`` changes them at a skip, perhaps before we read it)."""
    as_run = getattr(plugin, "_islands_as_run", None)
    return list(as_run() if callable(as_run) else getattr(plugin, "fp32_module_names", []))


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


def _loss_value(loss: Optional[Tensor]) -> Union[float, str, None]:
    """The step's mean loss as a record keeps it: a float, or ``"inf"``, ``"-inf"``, ``"nan"`` (JSON holds no inf)."""
    if loss is None:
        return None
    value = float(loss.detach().float().mean().item())
    return value if math.isfinite(value) else "nan" if value != value else "inf" if value > 0 else "-inf"
