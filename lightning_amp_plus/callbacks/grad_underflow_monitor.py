"""GradUnderflowMonitor: where the scaled gradients sit in float16's range (underflow fraction and headroom)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus._limits import GRAPH_NODES, scale_floor
from lightning_amp_plus._ranks import all_reduce_
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._validation import check_bool, check_fraction, check_int, check_prefix
from lightning_amp_plus._warnings import warn_at_user
from lightning_amp_plus.callbacks._common import (
    find_plugin,
    is_logging_step,
    local_tensor,
    log_to_all,
    logging_interval,
    parameters_and_names,
    shards_gradients,
)
from lightning_amp_plus.engine import UpdateListener
from lightning_amp_plus.forensics.observe import BatchRecord
from lightning_amp_plus.precision import AmpPlusPrecision, logger_step
from lightning_amp_plus.syncs import to_host

FP16_SMALLEST_NORMAL = 2.0**-14  # below it float16 has fewer than 11 significant bits, down to none at 2**-25
FP16_MAX = 65504.0


def underflow_fraction(below: float, zeros: float, total: float) -> Optional[float]:
    """Of the ``total - zeros`` non-zero elements, the fraction of the ``below - zeros`` below the smallest normal.

    The one definition of the underflow figure (whole run, per parameter, logged and warned on). None when no
    element is non-zero: a fraction of nothing is undefined, and every gradient being zero is no healthy 0.

    Example:
        >>> underflow_fraction(below=40, zeros=30, total=100)  # 30 zeros (left out), 10 of the 70 others subnormal
        0.14285714285714285
        >>> underflow_fraction(below=5, zeros=5, total=5) is None  # nothing non-zero: flushed, or unused
        True
    """
    nonzero = total - zeros
    return (below - zeros) / nonzero if nonzero > 0 else None


#: backward nodes that only move, slice, sum or cast the gradient they receive: it keeps the dtype it was made in
_PASS_THROUGH = frozenset(
    {
        "SumBackward", "ExpandBackward", "ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward",
        "UnsqueezeBackward", "SqueezeBackward", "PermuteBackward", "TransposeBackward", "TBackward", "SelectBackward",
        "SliceBackward", "CloneBackward", "UnbindBackward", "SplitBackward", "SplitWithSizesBackward", "CatBackward",
        "StackBackward", "IndexBackward", "AsStridedBackward", "ToCopyBackward",
    }
)  # fmt: skip


def float32_only(losses: list[Tensor]) -> set[int]:
    """The ``id`` of every parameter whose gradient reached it from ``losses`` in float32 only, never in float16.

    Read from the autograd graph the step built, which outlives its backward: a parameter autocast cast to float16
    gets its gradient through the cast's backward, which received it in float16 (through nodes that only move or sum
    it, the dtype it was made in counts). A parameter used in float32 only (an fp32 island, a LayerNorm, an embedding,
    a positional embedding added to a float32 sum) never had its gradient in float16: its figures say nothing about
    float16's range. A parameter the graph does not reach (a gradient set by hand) is not in the set. No user code
    runs, no device op. A compiled graph's backward is opaque: the parameters it reaches are measured.
    """
    stack = [(loss.grad_fn, False) for loss in losses if loss.grad_fn is not None]
    half: set[int] = set()
    full: set[int] = set()
    seen: set[tuple[Any, bool]] = set()
    while stack and len(seen) < GRAPH_NODES:  # deeper: torch crashes freeing the graph (a parameter unread is measured)
        node, came_half = stack.pop()
        if (node, came_half) in seen:
            continue
        seen.add((node, came_half))
        name = node.name().rstrip("0123456789")
        metadata = getattr(node, "_input_metadata", None)
        if metadata is not None:
            in_half = any(getattr(m, "dtype", None) == torch.float16 for m in metadata)
        else:  # older torch: a cast's backward is what autocast puts between a float32 parameter and float16 work
            in_half = name == "ToCopyBackward"
        in_half = in_half or (came_half and name in _PASS_THROUGH)
        in_half = in_half or name.startswith("CompiledFunction")  # a compiled graph's casts are hidden: measured
        for following, _ in node.next_functions:
            if following is None:
                continue
            variable = getattr(following, "variable", None)
            if variable is None:
                stack.append((following, in_half))
            elif in_half or variable.dtype == torch.float16:
                half.add(id(variable))
            else:
                full.add(id(variable))
    return full - half


def _magnitudes(reference: list[Tensor], device: torch.device, activations: Optional[Tensor] = None) -> Tensor:
    """``[log2 max |g|, the fitting scale's exponent, non-zero elements still lost there]`` of a reference.

    The largest gradient is the weights' or, when larger, the activations' (``activations``: the largest gradient at
    a module's output): a scale must fit the whole backward. The fitting scale is the largest power of two that keeps
    it a doubling below float16's overflow; the elements still lost there are the weights' non-zero ones it leaves
    below float16's smallest normal. On the device, no host read (the measurement's one transfer carries them).
    """
    present = [r.detach().float() for r in reference if r.numel()]
    if not present:
        return torch.tensor([-math.inf, math.inf, 0.0], device=device)
    largest = torch.stack([m.to(device) for m in torch._foreach_norm(present, float("inf"))]).max()
    if activations is not None:
        largest = torch.maximum(largest, activations.to(device).float())
    log2_max = torch.log2(largest)
    exponent = torch.floor(math.log2(FP16_MAX) - log2_max) - 1  # inf when every element is zero: nothing counted
    threshold = FP16_SMALLEST_NORMAL / torch.exp2(exponent.clamp(max=126.0))  # |g| below it is lost at that scale
    lost = torch.stack([((r != 0) & (r.abs() < threshold.to(r.device))).sum().to(device) for r in present]).sum()
    return torch.stack([log2_max, exponent, lost.float()])


@dataclass
class _Update:
    """One update's measurement until it closes, declared with how each figure reduces.

    ``rows``: per parameter (by id; one measured again, by a second optimizer: the latest), its name and its counts
    ``[float16's exact zeros, elements below float16's smallest normal, elements, structural zeros]``, summed over
    the ranks when sharded. ``largest``: each optimizer's largest gradient (the maximum over them and the ranks).
    ``true``: the float32 reference's figures (``_magnitudes``), ``reference_error`` what it raised.
    """

    step: int
    scale: Tensor
    rows: dict[int, tuple[str, Tensor]] = field(default_factory=dict)
    largest: list[Tensor] = field(default_factory=list)
    true: Optional[Tensor] = None
    reference_error: Optional[str] = None


def _counts(grads: list[Optional[Tensor]], reference: Optional[list[Tensor]], device: torch.device) -> Tensor:
    """Per gradient (a row): float16's exact zeros, elements below its smallest normal, elements, structural zeros.

    Without a reference a zero cannot be told structural or flushed (every zero counts as structural); with it an
    element is structural when its float32 gradient is zero, lost when only float16's is.
    """
    if not grads:
        return torch.zeros(0, 4, device=device)
    none = torch.zeros((), device=device)
    zeros = torch.stack([none if g is None else (g == 0).sum().float().to(device) for g in grads])
    if reference is None:
        structural = zeros
        below = torch.stack(
            [none if g is None else (g.abs() < FP16_SMALLEST_NORMAL).sum().float().to(device) for g in grads]
        )
    else:
        structural = torch.stack([(r == 0).sum().float().to(device) for r in reference])
        lost = [
            none if g is None else ((g.abs() < FP16_SMALLEST_NORMAL) & (r != 0)).sum().float().to(device)
            for g, r in zip(grads, reference, strict=True)
        ]
        below = structural + torch.stack(lost)
    sizes = torch.tensor([0 if g is None else g.numel() for g in grads], dtype=torch.float32, device=device)
    return torch.stack([zeros, below, sizes, structural], dim=1)


class GradUnderflowMonitor(KnobsRepr, UpdateListener, Callback):
    """Measure the scaled gradients before they are unscaled, every ``every_n_steps`` optimizer steps (16-mixed).

    Measures on the steps Lightning logs ``self.log`` values at (the last step of each interval: 9, 19, ... for 10),
    so its rows share the logger's step with every other series. Only the gradients float16 held count: a
    parameter whose gradient reached it in float32 (an fp32 island, a LayerNorm, a positional embedding added in
    float32) is left out, read from the autograd graph the step built. Logs to every logger, at the step measured:

    * ``{prefix}underflow_fraction``: of the non-zero gradient elements, the fraction whose scaled magnitude is below
      float16's smallest normal (``2**-14``): subnormal in float16, losing significant bits, the tail of what float16
      flushes to zero. Absent when no element is non-zero (every gradient zero: flushed or unused, see
      ``zero_fraction``) and when the update overflowed: no fraction exists there;
    * ``{prefix}zero_fraction``: the fraction of gradient elements that are exactly zero. Most are structural (the
      rows of an embedding a batch did not use, dead units) and not lost to fp16; values flushed all the way to zero
      cannot be told from them without a float32 backward, so they are counted here, not as underflow. 1.0 with a
      finite, non-zero loss is a run that trains on nothing (``AmpAdvisor`` says so);
    * ``{prefix}headroom_bits``: ``log2(65504 / max |scaled gradient|)``, how many doublings of the scale remain
      before the largest gradient overflows (omitted when the step overflowed or every gradient is zero);
    * with ``exact=True``, ``{prefix}structural_fraction``: the elements whose float32 gradient is zero;
    * with ``per_parameter=k``, ``{prefix}underflow/<name>`` for the ``k`` parameters with the highest underflow
      fraction (zeros excluded, as above).

    By default it reads only what the run computed: computed on the device (a foreach max-norm and two counts per
    gradient), one host transfer per measurement, nothing on the other steps, and no user code. ``exact=True`` opts
    in to a float32 reference: at each measurement the batch's ``training_step`` runs a second time, in float32, in a
    sandbox (parameters and buffers are stand-ins, every random stream is given back, it starts from the random state
    the batch started with, and what it raises is reported, never raised). Then an element whose float32 gradient is
    zero is structural, one whose float32 gradient is not zero while float16's is zero or subnormal is lost, and the
    scale that would fit the gradients is measured (``AmpAdvisor``'s ``max_scale`` and ``bf16`` advice read it). Its
    contract: the step may not act outside the model (step an environment, write a file, call a logger directly),
    which the sandbox cannot undo; it is off for manual optimization, accumulation and sharded models. The fit says
    that it is on when it starts.

    Warns (rank zero, at most ``max_warnings`` times) when the underflow fraction stays at or above ``warn_fraction``
    for ``patience`` measurements in a row while the scale sits at its floor. :attr:`measurements` keeps
    ``{step, scale, loss, underflow_fraction, zero_fraction, headroom_bits, reference, ...}``.

    Args:
        every_n_steps: measure every this many optimizer steps (default: ``Trainer(log_every_n_steps)``).
        per_parameter: also log this many worst parameters (default 0).
        warn_fraction: underflow fraction that counts as high (default 0.5).
        patience: high measurements in a row before warning (default 3).
        max_warnings: warnings at most (default 3).
        prefix: key prefix (default ``"amp/"``).
        exact: measure against a float32 reference that runs ``training_step`` again, sandboxed (default False).
        quiet: measurements only, no metric and no warning (for a callback that holds this one, as ``AmpAdvisor``).

    Example:
        >>> from lightning_amp_plus import GradUnderflowMonitor
        >>> GradUnderflowMonitor(every_n_steps=10).measurements
        []
    """

    # set at setup (and the parameters again at fit start, as trained)
    _update: Optional[_Update]  # the update being measured, until it closes (the batch's end)
    _names: dict[int, str]
    _params: list[tuple[str, torch.nn.Parameter]]
    _sharded: bool
    _interval: int

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        per_parameter: int = 0,
        warn_fraction: float = 0.5,
        patience: int = 3,
        max_warnings: int = 3,
        prefix: str = "amp/",
        exact: bool = False,
        quiet: bool = False,
    ) -> None:
        self._given = given_arguments(GradUnderflowMonitor.__init__, locals())
        self._fit_scope = FitScope()
        owner = type(self).__name__
        if every_n_steps is not None:
            check_int(owner, "every_n_steps", every_n_steps, minimum=1)
        check_int(owner, "per_parameter", per_parameter, minimum=0)
        check_int(owner, "patience", patience, minimum=1)
        check_int(owner, "max_warnings", max_warnings, minimum=0)
        self.every_n_steps = every_n_steps
        self.per_parameter = per_parameter
        self.warn_fraction = check_fraction(owner, "warn_fraction", warn_fraction)
        self.patience = patience
        self.max_warnings = max_warnings
        self.prefix = check_prefix(owner, prefix)
        self.exact = check_bool(owner, "exact", exact)
        self.measurements: list[dict[str, Any]] = []
        self.no_reference: Optional[str] = None  # why this fit's measurements have no float32 reference
        self._batch_state: Optional[tuple[int, BatchRecord]] = None  # the measured batch, for its reference
        self._losses: list[Tensor] = []  # the measured batch's losses: their graph tells what float16 held
        self._activations: Optional[Tensor] = None  # the reference's largest gradient at a module's output
        self._measuring = False  # this batch is measured
        self.quiet = check_bool(owner, "quiet", quiet)
        self._plugin: Optional[AmpPlusPrecision] = None
        self._trainer: Optional[pl.Trainer] = None
        self._high = 0
        self._warned = 0
        self._first: Optional[int] = None  # the logger step of this fit's first batch
        self._first_too = False  # measure the fit's first update as well (the advisor's: a short fit is read too)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        plugin = find_plugin(trainer, type(self).__name__)
        self._plugin = plugin
        if stage == "fit":
            self._update = None  # no update spans two fits (a retry on the same Trainer measures a failed step again)
            if self._fit_scope.starts_afresh(trainer):  # a new Trainer's fit starts afresh
                self.measurements = []
                self._high = 0
                self._warned = 0
        self._trainer = trainer
        self._interval = logging_interval(trainer, self.every_n_steps)
        self._params, self._names = parameters_and_names(pl_module)
        if plugin.scaler is None:
            if self.quiet:
                return
            warn_at_user(
                "`GradUnderflowMonitor` measures float16 underflow of scaled gradients; with bf16-mixed there is no"
                " scaler and bfloat16 has float32's range, so it measures nothing."
            )
            return
        plugin.listen(self)  # the plugin forgets its listeners at its teardown, failed or not

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the parameters as trained: FSDP2's `fully_shard` (in `configure_model`, after `setup`) replaces them
        self._params, self._names = parameters_and_names(pl_module)
        self._sharded = shards_gradients(trainer)
        self._batch_state = None
        self._losses, self._measuring = [], False
        self._first = None
        self.no_reference = "exact=False"
        if self.exact:  # asked for by name: the opt-in rerun is loaded now
            from lightning_amp_plus.forensics.opt_in.rerun import announce, why_no_reference

            self.no_reference = why_no_reference(trainer, self._sharded)
        if self._plugin is None or self._plugin.scaler is None:
            self.no_reference = "bf16-mixed (nothing is measured)"
        elif self.no_reference is None and trainer.is_global_zero:
            announce("GradUnderflowMonitor(exact=True)", f"every {self._interval} steps, in float32,")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = logger_step(pl_module)
        if self._first is None:
            self._first = step
        self._measuring = step is not None and self._measures(step)
        self._losses = []
        if self._measuring and self.no_reference is None:
            assert step is not None
            assert self._plugin is not None
            from lightning_amp_plus.forensics.opt_in.sandbox import capture, copied_inputs, streams

            # a copy: the step may change its batch in place; the reference sees it as it came
            start = capture(streams(self._plugin.device or "cpu", pl_module))
            self._batch_state = (step, BatchRecord(copied_inputs(batch), batch_idx, start=start))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._measuring:
            self._losses.append(loss)  # its graph (kept until the batch ends) tells which gradients float16 held

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close_update()
        self._batch_state = None  # the batch is released
        self._losses, self._measuring = [], False

    def _reference(self, optimizer: Optimizer, step: int, keys: list[int]) -> Optional[list[Tensor]]:
        """The measured gradients' float32 reference (zero for a parameter without one), or None."""
        if self._batch_state is None or self._batch_state[0] != step or self._trainer is None:
            return None
        by_id = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        params = [by_id[k] for k in keys]
        from lightning_amp_plus.forensics.opt_in.rerun import float32_gradients  # exact=True: loaded at setup

        reference, error = float32_gradients(
            self._trainer.lightning_module,
            self._batch_state[1],
            params,
            self._plugin.device or "cpu",  # type: ignore[union-attr]
        )
        if reference is None:
            assert self._update is not None
            self._update.reference_error = error
            return None
        self._activations = reference[-1]  # the largest gradient at a module's output: a scale must fit it too
        return [torch.zeros_like(p) if r is None else r for r, p in zip(reference[:-1], params, strict=True)]

    def _gradients(self, optimizer: Optimizer) -> tuple[list[str], list[int], list[Optional[Tensor]]]:
        """The gradients measured: every parameter's shard when sharded, else ``optimizer``'s that float16 held."""
        names: list[str] = []
        keys: list[int] = []
        grads: list[Optional[Tensor]] = []
        if self._sharded:  # this rank's shard of every parameter (maybe empty), summed over the ranks below
            for name, param in self._params:
                names.append(name)
                keys.append(id(param))
                grads.append(None if param.grad is None or param.grad.is_sparse else local_tensor(param.grad))
            return names, keys, grads
        float32 = float32_only(self._losses)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None or param.grad.is_sparse or id(param) in float32:
                    continue
                names.append(self._names.get(id(param), f"<unnamed {tuple(param.shape)}>"))
                keys.append(id(param))
                grads.append(local_tensor(param.grad))
        return names, keys, grads

    def _measures(self, step: int) -> bool:
        """Whether the update at ``step`` is measured: a logging step's (and, for the advisor, the fit's first)."""
        return is_logging_step(step, self._interval) or (self._first_too and step == self._first)

    @override
    def before_unscale(self, optimizer: Optimizer, step: int) -> None:
        if not self._measures(step):
            return
        assert self._plugin is not None
        assert self._plugin.scaler is not None
        names, keys, grads = self._gradients(optimizer)
        present = [g for g in grads if g is not None and g.numel() > 0]
        if not present and not self._sharded:
            return
        scale = self._plugin.scaler.scale_tensor()
        assert scale is not None
        if self._update is None or self._update.step != step:
            self._update = _Update(step, scale.detach().clone())  # the scale moves when the update closes
        update = self._update
        with torch.no_grad():  # on the device: the update's one host transfer is at its close
            self._activations = None
            reference = self._reference(optimizer, step, keys)
            counts = _counts(grads, reference, scale.device)
            update.rows.update({key: (names[i], counts[i]) for i, key in enumerate(keys)})  # again: the latest
            if present:
                update.largest.append(
                    torch.stack([m.float().to(scale.device) for m in torch._foreach_norm(present, float("inf"))]).max()
                )
            if reference is not None:
                update.true = _magnitudes(reference, scale.device, self._activations)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        with contextlib.suppress(Exception):  # what a failed step measured is kept; the fit's error is the one raised
            self._close_update()
        self._update, self._losses, self._batch_state = None, [], None

    def _close_update(self) -> None:
        """Record the update measured in this batch (every optimizer's part of it): one host transfer."""
        update, self._update = self._update, None
        if update is None or not update.rows:
            return
        device = update.scale.device
        none = torch.zeros((), device=device)
        largest = torch.stack(update.largest).max() if update.largest else none
        loss = none + math.nan  # no loss kept (a manual step that logs none): not known
        if self._losses:
            loss = torch.stack([x.detach().float().mean().to(device) for x in self._losses]).sum()
        rows = torch.stack([row for _, row in update.rows.values()])
        summed = torch.cat([loss.reshape(1), rows.flatten()])
        if self._sharded:  # counts summed over the ranks (each holds a shard), the largest their maximum
            all_reduce_(summed)
            summed[0] /= torch.distributed.get_world_size()  # the loss, averaged over the ranks
            largest = all_reduce_(largest.reshape(1).clone(), op="max").reshape(())
        true = update.true if update.true is not None else torch.zeros(0, device=device)
        values = to_host(torch.cat([largest.reshape(1), update.scale.reshape(1).to(device), summed, true]))
        self._record(update, values)

    def _record(self, update: _Update, values: list[float]) -> None:
        """One record of a measured update (see ``_Update`` for the figures ``values`` holds)."""
        largest_value, scale_value, loss_value = values[0], values[1], values[2]
        n = len(update.rows)
        counts = [values[3 + 4 * i : 7 + 4 * i] for i in range(n)]  # zeros, below, elements, structural
        names = [name for name, _ in update.rows.values()]
        true_values = values[3 + 4 * n :]
        total = sum(c[2] for c in counts)
        if not total:
            return
        structural = sum(c[3] for c in counts)
        overflowed = not math.isfinite(largest_value)  # inf/nan: no fraction of the gradients exists
        below = sum(c[1] for c in counts)
        record: dict[str, Any] = {
            "step": update.step,
            "scale": scale_value,
            "loss": loss_value if math.isfinite(loss_value) else None,
            "underflow_fraction": None if overflowed else underflow_fraction(below, structural, total),
            "zero_fraction": sum(c[0] for c in counts) / total,
            "headroom_bits": math.log2(FP16_MAX / largest_value) if not overflowed and largest_value > 0 else None,
            "reference": "float32" if update.true is not None else None,
        }
        if update.reference_error is not None:
            record["reference_error"] = update.reference_error
        if update.true is not None:
            record["structural_fraction"] = structural / total
            log2_max, exponent, lost = true_values
            nonzero = total - structural
            record["true_log2_max"] = log2_max if math.isfinite(log2_max) else None
            if math.isfinite(log2_max) and nonzero:  # the scale the reference fits, and what float16 loses there
                record["fitting_scale"] = 2.0**exponent
                record["lost_at_fitting_scale"] = lost / nonzero
        if self.per_parameter and not overflowed:
            ranked = sorted(
                (
                    (underflow_fraction(c[1], c[3], c[2]), nm)
                    for c, nm in zip(counts, names, strict=True)
                    if c[2] > c[3]
                ),
                reverse=True,
            )
            record["worst"] = [{"name": nm, "underflow_fraction": f} for f, nm in ranked[: self.per_parameter]]
        self.measurements.append(record)
        if not self.quiet:
            log_to_all(self._trainer, self._metrics(record), update.step)  # type: ignore[arg-type]
            self._check(record)

    def _metrics(self, record: dict[str, Any]) -> dict[str, float]:
        """The logged series of one record: each key where its figure exists, never a healthy-looking stand-in."""
        metrics = {f"{self.prefix}zero_fraction": record["zero_fraction"]}
        for key in ("underflow_fraction", "headroom_bits", "structural_fraction"):
            if record.get(key) is not None:
                metrics[f"{self.prefix}{key}"] = record[key]
        for worst in record.get("worst", []):
            metrics[f"{self.prefix}underflow/{worst['name']}"] = worst["underflow_fraction"]
        return metrics

    def _check(self, record: dict[str, Any]) -> None:
        assert self._plugin is not None
        assert self._plugin.scaler is not None
        min_scale = self._plugin.scaler.knobs()["min_scale"]
        at_floor = record["scale"] <= scale_floor(min_scale)
        fraction = record["underflow_fraction"]
        if fraction is None:
            return  # an overflowed update says nothing about underflow: the streak neither grows nor breaks
        self._high = self._high + 1 if (at_floor and fraction >= self.warn_fraction) else 0
        if self._high >= self.patience and self._warned < self.max_warnings:
            self._warned += 1
            self._high = 0
            warn_at_user(
                f"`GradUnderflowMonitor`: {100 * record['underflow_fraction']:.0f}% of gradient elements underflow"
                f" float16 while the loss scale sits at min_scale={min_scale:g} (step"
                f" {record['step']}). HINT: raise `min_scale` or `init_scale`, use precision='bf16-mixed', or keep"
                " the layers with tiny gradients in float32 (`AmpPlusPrecision(fp32_modules=[...])`)."
            )
