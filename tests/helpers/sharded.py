"""Sharded training on CPU for the tests: FSDP1 through ``examples/fsdp.py``'s ``CPUFSDPStrategy``, FSDP2 through
``ModelParallelStrategy``.

Lightning's accelerator connector refuses ``FSDPStrategy`` on CPU (an exact-type check), and FSDP1 needs
``device_id=torch.device("cpu")`` there; the example's subclass provides both. Multi-process runs execute a script in a
subprocess (Lightning re-launches it for rank 1), each rank writing what it saw to ``OUT/rank{N}.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from typing import Any, NoReturn

from lightning.pytorch import Callback

from examples.fsdp import CPUFSDPStrategy

__all__ = ["CPUFSDPStrategy", "ExitWithoutFinalizing", "ended", "leave", "run_script"]


def _exit_now(code: Any = 0) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


def leave() -> NoReturn:
    """End a test's rank process once what it saw is written: both ranks past a barrier, then out without Python's
    finalization. There torch aborts a process at random ("terminate called without an active exception", SIGABRT):
    a gloo worker thread drops a tensor, taking the GIL, while the interpreter is torn down (pytorch/pytorch#190489,
    #179291; `destroy_process_group()` does not stop it while a wrapped module still holds the group). The test's
    outcome is in the files by then, and an abort after them is no failure of the code under test."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    _exit_now(0)


def ended(done: subprocess.CompletedProcess[Any]) -> bool:
    """Whether a script (an example: user code, which ends as a user's script does) ran to its end: exit code 0, or
    torch's abort at interpreter exit after it (`leave`'s cause: SIGABRT with torch's message). The caller asserts
    what the script wrote."""
    stderr = done.stderr if isinstance(done.stderr, str) else (done.stderr or b"").decode(errors="replace")
    return done.returncode == 0 or (done.returncode == -6 and "terminate called without an active exception" in stderr)


class ExitWithoutFinalizing(Callback):
    """``ddp_spawn`` in a test: each spawned rank process ends as `leave` does, its exit code kept (0 after the fit
    returned its results, 1 after torch's spawn wrapper wrote the error), where the spawn module calls ``sys.exit``."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if multiprocessing.parent_process() is not None:  # a spawned rank, not the test's own process
            sys.exit = _exit_now


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str, out: Any, *args: str, timeout: int = 300) -> list[dict[str, Any]]:
    """Run ``script`` (source text) with ``out`` and ``args``; return each rank's ``rank{N}.json``."""
    path = os.path.join(os.fspath(out), "script.py")
    with open(path, "w") as f:
        f.write(script)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, path, os.fspath(out), *args],
        cwd=ROOT,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise AssertionError(f"the script failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(os.fspath(out), f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    ranks[0]["_stderr"] = done.stderr
    return ranks


class FakePeer:
    """One process standing for rank 0 of two: ``torch.distributed`` says a 2-rank group is up, and every
    ``all_reduce`` combines this rank's tensor with what the other rank holds, ``peer(tensor, op)`` (a tensor of the
    same shape), by the reduce op. Tests the reduction rules on one rank with exact values from "the other".
    """

    def __init__(self, monkeypatch: Any, peer: Any) -> None:
        import torch

        self.peer = peer
        self.calls: list[dict[str, Any]] = []
        monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)
        monkeypatch.setattr(torch.distributed, "all_gather_object", self.all_gather_object)
        self.told: Any = None  # what the other rank contributes to an object gather (an origin it could not tell)

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        out[0], out[1] = obj, self.told

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        import torch

        op = torch.distributed.ReduceOp.SUM if op is None else op
        other = self.peer(tensor, op).to(tensor)
        self.calls.append({"op": op, "group": group, "mine": tensor.clone(), "theirs": other})
        if op == torch.distributed.ReduceOp.MAX:
            torch.maximum(tensor, other, out=tensor)
        else:
            tensor.add_(other)
