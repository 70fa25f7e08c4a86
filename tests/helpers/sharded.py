"""Sharded training on CPU for the tests: FSDP1 through ``examples/fsdp.py``'s ``CPUFSDPStrategy``, FSDP2 through
``ModelParallelStrategy``.

Lightning's accelerator connector refuses ``FSDPStrategy`` on CPU (an exact-type check), and FSDP1 needs
``device_id=torch.device("cpu")`` there; the example's subclass provides both. Multi-process runs execute a script in a
subprocess (Lightning re-launches it for rank 1), each rank writing what it saw to ``OUT/rank{N}.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from examples.fsdp import CPUFSDPStrategy

__all__ = ["CPUFSDPStrategy", "run_script"]

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
