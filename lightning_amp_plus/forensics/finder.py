"""OriginFinder: where a skip's inf/nan were born, the one component the reporter holds and the advisor reads.

Observe by default: the batch and the losses; after the first skip whose loss held inf/nan, a watch on every module.
``watch=True`` watches from the start; ``replay=True`` (asked for by name) also measures a forward origin's float32
verdict and islands (:func:`~.replay.measure`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_amp_plus.forensics._safe import attempt
from lightning_amp_plus.forensics._tree import torch_only
from lightning_amp_plus.forensics.observe import BatchRecord, Watch, batch_rows, nonfinite_kinds, read
from lightning_amp_plus.forensics.origin import EARLIER_MICRO_BATCH, WATCHING, Origin, Phase, unknown
from lightning_amp_plus.forensics.verdict import first_born, read_origin
from lightning_amp_plus.listener import UpdateListener


class OriginFinder(UpdateListener):
    """Tell where a skipped update's non-finite values were born, from what the step computed.

    :meth:`attach` at fit start; :meth:`start_batch` and :meth:`take_batch` around each training batch, its losses
    appended to ``current.losses``; :meth:`origin` on a skip, then :meth:`watch_if_asked` with the origin told over
    every rank.
    It listens to the plugin (:meth:`step_starting`).

    Example:
        >>> finder = OriginFinder()
        >>> finder.origin(BatchRecord(torch.tensor([float("nan")]), losses=[torch.tensor(float("nan"))])).to_dict()
        {'phase': 'input', 'reason': 'every module is watched from the next step'}
        >>> finder.origin(BatchRecord(torch.tensor([float("nan")]), losses=[torch.tensor(1.0)])).to_dict()
        {'phase': 'backward', 'batch': 'nonfinite'}
    """

    def __init__(self, watch: bool = False, replay: bool = False) -> None:
        self.from_start, self.replay = watch or replay, replay
        self.watch = Watch()
        self.current: Optional[BatchRecord] = None  # the batch being observed
        self.last: Optional[BatchRecord] = None  # the one handed over last
        self._recorder: Any = None  # the replay's Recorder (find_origin="replay" only)
        self._model: Optional[torch.nn.Module] = None
        self._context: Callable[[], Any] = contextlib.nullcontext
        self._islands: Callable[[], list[str]] = list
        self._accumulating = self._rerun = self._told = False
        self._device = "cpu"
        self._unwatchable: Optional[str] = None  # why no module can be watched
        self._compiled = 0  # the frames torch.compile had compiled as the fit started

    def attach(
        self,
        model: torch.nn.Module,
        context: Callable[[], Any],
        islands: Callable[[], list[str]] = list,
        accumulating: bool = False,
        sharded: bool = False,
        rerun: bool = False,
    ) -> Optional[str]:
        """Observe ``model``'s training batches; a replay runs under ``context`` (autocast), ``islands`` in float32.

        ``accumulating``: only an update's last micro-batch is read (a finite one cannot say "backward"); ``rerun``:
        each batch's random state is kept (a rerun of its step starts there). Returns what :meth:`start_watching`
        says, watching from the start.
        """
        self.detach()
        self._model, self._context, self._islands = model, context, islands
        self._accumulating, self._rerun, self._told = accumulating, rerun, False
        self._compiled = _compiled_frames()
        device = getattr(model, "device", None)
        self._device = device.type if isinstance(device, torch.device) else "cpu"
        self._unwatchable = (
            "no module named: the model is sharded (FSDP), its modules are not watched"
            if sharded
            else "no module named: the LightningModule is compiled as a whole (a hook would be traced into its graph)"
            if getattr(model, "_compiler_ctx", None) is not None
            else None
        )
        return self.start_watching() if self.from_start else None

    def detach(self) -> None:
        """Take every hook off; forget the batch and the model."""
        self.watch.remove()
        if self._recorder is not None:
            self._recorder.remove()
        self._recorder = self.current = self.last = self._model = None
        self._context, self._islands = contextlib.nullcontext, list

    @property
    def watching(self) -> bool:
        """Whether every module is watched."""
        return self.watch.on

    def start_watching(self) -> Optional[str]:
        """Watch every module from the next batch on (and record calls, to replay); say once what cannot be."""
        if self._model is None or self.watch.on or self._told:
            return None
        if self._unwatchable is not None:
            self._told = True
            return f"{self._unwatchable}; skips are told from the batch and the loss."
        self.watch.install(self._model)
        if self.replay:  # asked for by name: the opt-in replay is loaded now
            from lightning_amp_plus.forensics.opt_in.replay import Recorder

            self._recorder = Recorder(self._model, self.watch, self._device)
        self._told = bool(self.watch.unwatched)
        return f"every module is watched, but not inside: {', '.join(self.watch.unwatched)}." if self._told else None

    @property
    def _starts(self) -> tuple[Optional[str], ...]:
        """The reasons of a skip that start the watch: its loss held inf/nan where nothing was watched."""
        return (WATCHING, self._unwatchable, EARLIER_MICRO_BATCH)

    def watch_if_asked(self, origin: Optional[Origin]) -> Optional[str]:
        """Start the watch where ``origin`` asks for it; what :meth:`start_watching` says."""
        if origin is not None and origin.reason is not None and origin.reason in self._starts:
            return self.start_watching()
        return None

    def called_before(self, record: BatchRecord) -> list[str]:
        """The modules the step called itself, in order, before inf/nan first appeared (watched batches only)."""
        events = read(record.trace) if record.trace is not None else []
        found = first_born(events)
        depth, names = 0, []
        for index, *_ in events[: found.position if found is not None else len(events)]:
            depth += 1 if index >= 0 else -1
            if index < 0 and depth == 0:
                names.append(self.watch.names[~index])
        return names

    def start_batch(self, batch: Any, index: int = -1) -> None:
        """Observe this batch from now on: :attr:`current`, begun at once (:meth:`step_starting`)."""
        self.current = BatchRecord(batch, index)
        self.step_starting()

    def step_starting(self) -> None:
        """Begin observing :attr:`current` as its step starts (once a batch; the plugin calls it as a listener).

        Set ``finder.current = BatchRecord(batch, index)`` as the batch starts; until the watch is on, that and this are
        the finder's whole cost on a batch: the versions of the batch's own tensors as its step receives them (a
        tensor the step then changes in place, ``x.sub_(mean)``, is not read as the batch's, see
        :meth:`~.observe.BatchRecord.as_loaded`; what the hooks before the step wrote into it is). Watching, the
        watch's trace starts; with reruns, the random state and a copy of the batch are kept (a rerun starts there).
        """
        record = self.current
        if record is None or record.versions is not None:
            return
        batch = record.batch
        # its top-level items as `observe._top` reads them (the built-in types' own methods), inline: no Python call
        base: Any = dict if isinstance(batch, dict) else tuple if isinstance(batch, tuple) else list
        items = base.values(batch) if base is dict else base.__iter__(batch) if isinstance(batch, base) else ()
        record.versions = []
        with torch_only():
            for t in (batch,) if isinstance(batch, torch.Tensor) else items:  # a loop: no Python call of its own
                if issubclass(type(t), torch.Tensor) and not t.is_inference():  # type(): no `__class__` read
                    record.versions.append((t, t._version))
        if self.watch.on:
            rows, _ = attempt(batch_rows, batch)  # None where the batch cannot be read: no sample read per sample
            record.trace = self.watch.begin(rows)
            if self._recorder is not None:
                record.calls = self._recorder.calls = []
        if self._rerun:  # backward_origin=True, by name: the opt-in sandbox keeps what a rerun starts from
            from lightning_amp_plus.forensics.opt_in.sandbox import capture, copied_inputs, streams

            record.start = capture(streams(self._device, self._model))  # type: ignore[arg-type]
            record.loaded, _ = attempt(copied_inputs, batch)  # None where it cannot be copied: the batch itself

    def take_batch(self) -> Optional[BatchRecord]:
        """This batch's record, handed over (and kept as :attr:`last`); nothing more is kept until the next batch."""
        self.last, self.current = self.current, None
        if self.watch.on:
            if self.last is not None:
                self.last.unread = self.watch.unread
            self.watch.trace = None
            if self._recorder is not None:
                self._recorder.calls = None
        return self.last

    def origin(self, record: Optional[BatchRecord] = None) -> Optional[Origin]:
        """Where ``record``'s (default: this batch's) inf/nan were born (None: not told); never raises."""
        record = record if record is not None else self.current
        if record is None:
            return None
        with torch_only():  # what the step computed is read by torch's code alone
            told, error = attempt(self._read, record)
        return unknown(f"telling it raised {error}"[:200]) if error is not None else told

    def _read(self, record: BatchRecord) -> Optional[Origin]:
        events = read(record.trace) if record.trace is not None else None
        reason = self._unwatchable or WATCHING
        batch, unknown_kinds = record.as_loaded()  # as loaded: a tensor the step changed in place is not blamed
        names, losses = self.watch.names, frozenset(self.watch.loss_modules)
        origin = read_origin(batch, record.losses, events, names, self._islands(), self._accumulating, reason, losses)
        if (
            origin is not None
            and origin.own_code
            and not origin.batch_too
            and origin.kind in nonfinite_kinds(unknown_kinds)
        ):  # such a tensor holds that kind now: the batch may have held it as loaded (a rerun's copy tells)
            origin = origin.replace(batch_too=True)
        hidden = self.watch.hidden.get(origin.name, []) if origin is not None and origin.phase is Phase.FORWARD else []
        if origin is not None and hidden and origin.reason is None:
            place = "the LightningModule's own code" if origin.own_code else origin.name
            origin = origin.replace(reason=f"born in {place} or in {', '.join(hidden)} (compiled in place)"[:200])
        elif (
            origin is not None
            and events is not None
            and origin.reason is None
            and (origin.own_code or origin.phase is Phase.LOSS)
        ):
            live = record.trace is not None and record.trace is self.watch.trace  # its batch is still on
            unread = self.watch.unread if live else record.unread
            blind = unread if unread is not None else _compiled_code(self._compiled)
            origin = origin.replace(reason=blind) if blind is not None else origin
        found = first_born(events) if events is not None else None
        if origin is None or not origin.observed or not self.replay or record.calls is None or found is None:
            return origin
        from lightning_amp_plus.forensics.opt_in.replay import measure  # find_origin="replay", by name

        # the replay measures the islands every later overflow needs: the watched `also` is what it replaces
        if self._model is None:  # detached: nothing to replay on
            return origin
        return measure(
            origin.replace(also=()), record, found.start, self.watch, self._context, self._device, self._model
        )


def _compiled_frames() -> int:
    """How many frames ``torch.compile`` compiled in this process (0 where its dynamo was never imported)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(getattr(dynamo, "counters", {}).get("frames", {}).get("ok", 0)) if dynamo is not None else 0


def _compiled_code(since: int) -> Optional[str]:
    """Said of a watched skip no module was named for, where ``torch.compile`` compiled code in this fit."""
    if _compiled_frames() <= since:
        return None
    return "torch.compile compiled code in this fit: modules called from compiled code are not watched"
