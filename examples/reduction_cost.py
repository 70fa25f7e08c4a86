"""What a cross-rank figure costs: the callbacks' packed all-reduce against torchmetrics' ``Metric`` sync.

Runs 2 CPU processes (gloo) and counts, per logging point, the collectives each rank issues and the bytes it
receives, for the two figures the callbacks reduce across FSDP shards: ``NaNSkipReporter``'s per-parameter inf/nan
counts and ``GradUnderflowMonitor``'s underflow counts, element counts and largest gradient. torchmetrics is
measured with the states it would need, packed as ours are (``dist_reduce_fx="sum"``/``"max"``); its sync gathers
every state from every rank (sizes first, then data) and reduces locally, where a packed all-reduce moves one tensor
once. Both give the same figures (checked). The barriers torchmetrics runs around its gathers are not counted.

    python examples/reduction_cost.py [--params 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from typing import Any


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--params", type=int, default=200, help="parameters (tensors) in the model")
    parser.add_argument("--json", default=None, help="also write rank 0's figures here")
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Recorder:
    """Counts collectives and the bytes this rank receives through them, by wrapping torch.distributed's calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> Recorder:
        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return self._originals["all_reduce"](tensor, *args, **kwargs)

        def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in outputs)
            return self._originals["all_gather"](outputs, tensor, *args, **kwargs)

        for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather)):
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


def ours(counts: torch.Tensor, small: torch.Tensor, sizes: torch.Tensor, largest: torch.Tensor) -> list[Any]:
    """The callbacks' reductions (``_ranks.all_reduce_``): one packed tensor per figure."""
    from lightning_amp_plus._ranks import all_reduce_

    offenders = all_reduce_(counts.clone())  # NaNSkipReporter: every parameter's (inf, nan), one collective
    underflow = all_reduce_(torch.cat([small, sizes]))  # GradUnderflowMonitor: counts and element counts
    peak = all_reduce_(largest.reshape(1).clone(), op="max")
    return [offenders.tolist(), underflow.tolist(), peak.tolist()]


def with_torchmetrics(counts: torch.Tensor, small: torch.Tensor, sizes: torch.Tensor, largest: torch.Tensor) -> list:
    """The same figures as torchmetrics ``Metric`` states, synced by ``compute()``."""
    from torchmetrics import Metric

    class Offenders(Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("counts", default=torch.zeros_like(counts), dist_reduce_fx="sum")

        def update(self, value: torch.Tensor) -> None:
            self.counts += value

        def compute(self) -> torch.Tensor:
            return self.counts

    class Underflow(Metric):  # packed like ours: counts and element counts in one state
        def __init__(self) -> None:
            super().__init__()
            self.add_state("packed", default=torch.zeros(small.numel() + sizes.numel()), dist_reduce_fx="sum")
            self.add_state("largest", default=torch.zeros(()), dist_reduce_fx="max")

        def update(self, s: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> None:
            self.packed += torch.cat([s, n])
            self.largest = torch.maximum(self.largest, m)

        def compute(self) -> torch.Tensor:
            return torch.cat([self.packed, self.largest.reshape(1)])

    offenders, underflow = Offenders(), Underflow()
    offenders.update(counts)
    underflow.update(small, sizes, largest)
    both = underflow.compute()
    n = small.numel() + sizes.numel()
    return [offenders.compute().tolist(), both[:n].tolist(), both[n:].tolist()]


def worker(rank: int, port: int, params: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 3, (params, 2), generator=g, dtype=torch.int64)
    small = torch.randint(0, 100, (params,), generator=g).float()
    sizes = torch.full((params,), 1000.0)
    largest = torch.rand((), generator=g)
    result = {}
    for name, fn in (("ours", ours), ("torchmetrics", with_torchmetrics)):
        fn(counts, small, sizes, largest)  # warm up (torchmetrics' first sync sets things up)
        with Recorder() as recorder:
            figures = fn(counts, small, sizes, largest)
        result[name] = {"collectives": recorder.calls, "bytes_received": recorder.bytes, "figures": figures}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # no rank tears gloo down while its peer is still in a collective
    dist.destroy_process_group()


def measure(params: int = 200, out: str | None = None) -> dict[str, Any]:
    """Run the 2 processes and return rank 0's figures."""
    if out is None:
        with tempfile.TemporaryDirectory(prefix="reduction-cost-") as folder:
            return measure(params, folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, params, out), nprocs=2)
    with open(os.path.join(out, "rank0.json")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    result = measure(args.params)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    same = result["ours"]["figures"] == result["torchmetrics"]["figures"]
    print(f"# 2 processes (gloo), {args.params} parameters, one logging point of both callbacks; same figures: {same}")
    print("| reduction | collectives | bytes in their outputs, per rank |")
    print("|---|---:|---:|")
    for name, row in result.items():
        print(f"| {name} | {row['collectives']} | {row['bytes_received']} |")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
