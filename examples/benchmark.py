"""Benchmark: fp32 vs stock Lightning AMP vs AmpPlusPrecision (+ LossScaleMonitor and NaNSkipReporter).

Runs interleaved rounds (A B C, A B C, ...) and quotes medians, since shared machines are noisy. Host syncs per
step are counted in a separate, untimed round (`aten._local_scalar_dense` dispatches inside the training batches).

    python examples/benchmark.py --device {cpu,cuda} --precision {16-mixed,bf16-mixed} --size {default,small}
        --steps N [--rounds R]

A step is timed from one ``on_train_batch_start`` to the next, so everything the loop does per batch (the
callbacks' ``on_train_batch_end``, logging) is inside it. ``--size small`` is the host-bound case (MLP 256-512-4,
batch 8, ``gradient_clip_val=1.0``), where the package's per-step Python is what shows: the table then gives each
configuration's microseconds per step over stock. Rounds run the configurations in a shuffled order, and that
figure is the median over rounds of each round's difference to stock AMP, so a shared CPU whose speed drifts during
the run moves both sides of each difference alike.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import date
from typing import Any, Optional


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where every configuration runs")
    parser.add_argument(
        "--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed"], help="the mixed precision compared"
    )
    parser.add_argument("--steps", type=int, default=100, help="timed steps per round and configuration")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, each in a shuffled order")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    parser.add_argument(
        "--size",
        default="default",
        choices=["default", "small"],
        help="small: MLP 256-512-4, batch 8, gradient_clip_val=1.0 (host-bound steps)",
    )
    parser.add_argument(
        "--counts",
        action="store_true",
        help="print Python calls and aten ops per step instead of timing (CPU; deterministic)",
    )
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, GradUnderflowMonitor, LossScaleMonitor, NaNSkipReporter
from lightning_amp_plus.syncs import HostSyncCounter


class MLP(LightningModule):
    def __init__(self, sizes: tuple[int, int, int]) -> None:
        super().__init__()
        d_in, d_hidden, d_out = sizes
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Batches:
    """The same device-resident batch, ``n`` times (no data-loading cost in the figures)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
        self.x, self.y, self.n = x, y, n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.n):
            yield self.x, self.y

    def __len__(self) -> int:
        return self.n


class StepTimer(Callback):
    """Times each whole loop iteration: from one ``on_train_batch_start`` to the next (callbacks included)."""

    def __init__(self, device: str, warmup: int, count_syncs: bool = False) -> None:
        self.device, self.warmup, self.count_syncs = device, warmup, count_syncs
        self.times: list[float] = []
        self.syncs = 0
        self._counter: Optional[HostSyncCounter] = None
        self._t0: Optional[float] = None

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._sync()
        now = time.perf_counter()
        if self._t0 is not None and trainer.global_step > self.warmup:
            self.times.append(now - self._t0)
        self._t0 = now
        if self.count_syncs and trainer.global_step >= self.warmup:
            self._counter = HostSyncCounter()
            self._counter.__enter__()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.syncs += self._counter.count
            self._counter = None


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS (VmHWM) of this process
        except OSError:
            pass


def _peak_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class EmptyCallback(Callback):
    """A callback that does nothing: Lightning still dispatches every hook to it."""


def configs(
    device: str, precision: str, floor: bool = False
) -> dict[str, Callable[[], tuple[list[Precision], list[Callback]]]]:
    def fp32() -> tuple[list[Precision], list[Callback]]:
        return [], []

    def stock() -> tuple[list[Precision], list[Callback]]:
        scaler = torch.amp.GradScaler(device) if precision == "16-mixed" else None
        return [MixedPrecision(precision, device, scaler=scaler)], []  # type: ignore[arg-type]

    def stock_two_empty_callbacks() -> tuple[list[Precision], list[Callback]]:
        plugins, _ = stock()
        return plugins, [EmptyCallback(), EmptyCallback()]  # what Lightning charges for any two callbacks

    def plugin_alone() -> tuple[list[Precision], list[Callback]]:
        return [AmpPlusPrecision(precision)], []  # type: ignore[list-item]

    def plugin_two_empty_callbacks() -> tuple[list[Precision], list[Callback]]:
        return [AmpPlusPrecision(precision)], [EmptyCallback(), EmptyCallback()]  # type: ignore[list-item]

    def ours() -> tuple[list[Precision], list[Callback]]:
        return [AmpPlusPrecision(precision)], [LossScaleMonitor(), NaNSkipReporter()]  # type: ignore[arg-type]

    def ours_watching() -> tuple[list[Precision], list[Callback]]:  # what the watch costs once it is on
        reporter = NaNSkipReporter(find_origin="watch")
        return [AmpPlusPrecision(precision)], [LossScaleMonitor(), reporter]  # type: ignore[list-item]

    def ours_advised() -> tuple[list[Precision], list[Callback]]:
        plugin = AmpPlusPrecision(precision)
        return [plugin], [LossScaleMonitor(), NaNSkipReporter(), AmpAdvisor(print_advice=False)]  # type: ignore[list-item]

    def auto_islands() -> tuple[list[Precision], list[Callback]]:  # before any skip: a finder with no watch
        return [AmpPlusPrecision(precision, auto_islands=True)], []  # type: ignore[list-item]

    def underflow_exact() -> tuple[list[Precision], list[Callback]]:
        return [AmpPlusPrecision(precision)], [GradUnderflowMonitor(exact=True)]  # type: ignore[list-item]

    def underflow_inexact() -> tuple[list[Precision], list[Callback]]:
        return [AmpPlusPrecision(precision)], [GradUnderflowMonitor()]  # type: ignore[list-item]

    def ours_unchecked() -> tuple[list[Precision], list[Callback]]:
        plugin = AmpPlusPrecision(precision, skip_nonfinite=False)
        return [plugin], [LossScaleMonitor(), NaNSkipReporter()]  # type: ignore[list-item]

    table = {
        "fp32": fp32,
        "stock AMP": stock,
        "AmpPlusPrecision": plugin_alone,
        "AmpPlusPrecision + callbacks": ours,
        "AmpPlusPrecision + callbacks, watching": ours_watching,
        "AmpPlusPrecision + callbacks + AmpAdvisor": ours_advised,
    }
    if precision == "16-mixed":  # the float32 reference's cost: the same monitor with and without it
        table["AmpPlusPrecision(auto_islands=True)"] = auto_islands
        table["+ GradUnderflowMonitor(exact=True)"] = underflow_exact
        table["+ GradUnderflowMonitor()"] = underflow_inexact
    if floor:  # the small-step case: show what two callbacks cost whatever they do
        table = {
            **table,
            "stock AMP + 2 empty callbacks": stock_two_empty_callbacks,
            "AmpPlusPrecision + 2 empty callbacks": plugin_two_empty_callbacks,
        }
    if precision == "bf16-mixed":  # the non-finite check is the feature's price: show the run without it too
        table["AmpPlusPrecision(skip_nonfinite=False) + callbacks"] = ours_unchecked
    return table


def run_once(
    device: str,
    sizes: tuple[int, int, int],
    batch: int,
    steps: int,
    make: Callable,
    warmup: int,
    count_syncs: bool = False,
    clip: Optional[float] = None,
) -> tuple[list[float], float, int]:
    torch.manual_seed(0)
    x = torch.randn(batch, sizes[0], device=device)
    y = torch.randn(batch, sizes[2], device=device)
    plugins, callbacks = make()
    timer = StepTimer(device, warmup, count_syncs)
    with tempfile.TemporaryDirectory(prefix="amp-bench-") as log_dir:  # every config logs: the monitor's path is timed
        trainer = _trainer(device, plugins, [timer, *callbacks], steps + warmup, log_dir, clip)
        model = MLP(sizes)
        gc.collect()  # the previous rounds' garbage is not this configuration's cost
        _reset_peak(device)
        trainer.fit(model, train_dataloaders=Batches(x, y, steps + warmup))
    measured = max(1, trainer.global_step - warmup)
    return timer.times, _peak_mib(device), timer.syncs if count_syncs else measured


class _AtenCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every aten op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_fit(
    make: Callable, sizes: tuple[int, int, int], batch: int, steps: int, clip: Optional[float]
) -> tuple[int, int]:
    """Python function calls and aten ops of one whole ``fit`` of ``steps`` steps (deterministic for a config)."""
    import sys

    torch.manual_seed(0)
    x, y = torch.randn(batch, sizes[0]), torch.randn(batch, sizes[2])
    plugins, callbacks = make()
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    with tempfile.TemporaryDirectory(prefix="amp-count-") as log_dir:
        trainer = _trainer("cpu", plugins, callbacks, steps, log_dir, clip)
        model = MLP(sizes)
        aten = _AtenCounter()
        sys.setprofile(profile)
        try:
            with aten:
                trainer.fit(model, train_dataloaders=Batches(x, y, steps))
        finally:
            sys.setprofile(None)
    return calls, aten.count


def counts_per_step(table: dict[str, Callable], sizes: tuple[int, int, int], batch: int, clip: Optional[float]) -> None:
    """Print Python calls and aten ops per step: a 300-step fit minus a 100-step fit, over 200 (no timing noise).

    Then each configuration's difference to the floor its row compares with (stock AMP with two empty callbacks
    for configurations with callbacks, stock AMP for the plugin alone).
    """
    print(
        f"# {date.today()} | cpu | torch {torch.__version__} | lightning {lightning.__version__} | 16-mixed"
        f" | MLP {sizes} batch {batch} SGD{' clip 1.0' if clip else ''} | a 300-step fit minus a 100-step fit, / 200"
    )
    print("| config | Python calls/step | aten ops/step |")
    print("|---|---:|---:|")
    counts = {}
    for name, make in table.items():
        count_fit(make, sizes, batch, 5, clip)  # a first fit imports what the configuration needs: not a step's cost
        long_calls, long_ops = count_fit(make, sizes, batch, 300, clip)
        short_calls, short_ops = count_fit(make, sizes, batch, 100, clip)
        counts[name] = ((long_calls - short_calls) / 200, (long_ops - short_ops) / 200)
        print(f"| {name} | {counts[name][0]:.0f} | {counts[name][1]:.0f} |")
    for name, floor in (
        ("AmpPlusPrecision", "stock AMP"),
        ("AmpPlusPrecision + callbacks", "stock AMP + 2 empty callbacks"),
        ("AmpPlusPrecision + callbacks", "AmpPlusPrecision + 2 empty callbacks"),
        ("AmpPlusPrecision + callbacks, watching", "AmpPlusPrecision + callbacks"),
        ("AmpPlusPrecision + callbacks + AmpAdvisor", "AmpPlusPrecision + callbacks"),
        ("stock AMP + 2 empty callbacks", "stock AMP"),
    ):
        if name in counts and floor in counts:
            calls, ops = (counts[name][i] - counts[floor][i] for i in (0, 1))
            print(f"{name} over {floor}: {calls:+.0f} Python calls, {ops:+.0f} aten ops a step")


def _trainer(
    device: str, plugins: list, callbacks: list, max_steps: int, log_dir: str, clip: Optional[float]
) -> Trainer:
    return Trainer(
        accelerator=device,
        devices=1,
        plugins=plugins,
        callbacks=callbacks,
        max_steps=max_steps,
        logger=CSVLogger(log_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
        num_sanity_val_steps=0,
        gradient_clip_val=clip,
    )


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    clip: Optional[float] = None
    if args.size == "small":
        sizes, batch, clip = (256, 512, 4), 8, 1.0
    elif args.device == "cuda":
        sizes, batch = (4096, 2048, 1024), 256
    else:
        sizes, batch = (512, 256, 128), 64
    table = configs(args.device, args.precision, floor=args.size == "small")
    if args.counts:
        counts_per_step(table, sizes, batch, clip)
        return []
    times: dict[str, list[float]] = {name: [] for name in table}
    peaks: dict[str, float] = {name: 0.0 for name in table}
    order = random.Random(0)
    paired: dict[str, list[float]] = {name: [] for name in table}  # per round: this config's median - stock's
    for _ in range(args.rounds):  # interleaved rounds, each in a shuffled order: drift hits every config alike
        names = list(table)
        order.shuffle(names)
        round_medians = {}
        for name in names:
            t, peak, _ = run_once(args.device, sizes, batch, args.steps, table[name], args.warmup, clip=clip)
            times[name].extend(t)
            round_medians[name] = statistics.median(t)
            peaks[name] = max(peaks[name], peak)
        for name in table:
            paired[name].append(round_medians[name] - round_medians["stock AMP"])
    syncs = {}
    for name, make in table.items():
        sync_steps = max(4, min(args.steps, 20))
        _, _, count = run_once(args.device, sizes, batch, sync_steps, make, args.warmup, count_syncs=True, clip=clip)
        syncs[name] = count / sync_steps
    medians = {name: statistics.median(t) for name, t in times.items()}
    means = {name: statistics.fmean(t) for name, t in times.items()}  # an occasional step's cost shows in the mean
    rows = []
    for name in table:
        rows.append(
            {
                "config": name,
                "median_ms": medians[name] * 1e3,
                "mean_ms": means[name] * 1e3,
                "peak_mib": peaks[name],
                "syncs_per_step": syncs[name],
                "vs_stock": medians[name] / medians["stock AMP"],
                # the median over rounds of the paired difference: robust to a machine whose speed drifts
                "us_over_stock": statistics.median(paired[name]) * 1e6,
                "vs_fp32": medians[name] / medians["fp32"],
            }
        )
    mem = "peak alloc MiB" if args.device == "cuda" else "peak RSS MiB"
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'cpu'}"
    print(
        f"# {date.today()} | {args.device} ({where}) | torch {torch.__version__} | lightning {lightning.__version__}"
        f" | {args.precision} | MLP {sizes} batch {batch} SGD{' clip 1.0' if clip else ''}"
        f" | {args.rounds} rounds x {args.steps} steps"
    )
    print(
        f"| config | median step (ms) | mean step (ms) | {mem} | host syncs/step | vs stock | us/step over stock"
        " | vs fp32 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['config']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['peak_mib']:.0f}"
            f" | {r['syncs_per_step']:.2f} | {r['vs_stock']:.3f} | {r['us_over_stock']:+.0f} | {r['vs_fp32']:.3f} |"
        )
    if "+ GradUnderflowMonitor(exact=True)" in means:
        exact, inexact = means["+ GradUnderflowMonitor(exact=True)"], means["+ GradUnderflowMonitor()"]
        print(
            f"float32 reference (one float32 forward and backward every log_every_n_steps=50): "
            f"{100 * (exact - inexact) / means['stock AMP']:+.2f}% of stock AMP's mean step time"
        )
    return rows


if __name__ == "__main__":
    main()
