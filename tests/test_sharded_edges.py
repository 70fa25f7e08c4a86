"""Every rank makes the same skip decision: in bf16 too, and with a fused optimizer in a plain loop (2 processes)."""

import pytest

from tests.helpers.sharded import run_script

FSDP1_BF16 = r'''
import json, sys
import torch
from lightning.pytorch import Callback, Trainer
from lightning_amp_plus import AmpPlusFSDPPrecision, NaNSkipReporter
from tests.helpers.models import TinyModel
from tests.helpers.sharded import CPUFSDPStrategy

out = sys.argv[1]
POISON = {2, 3}


class ShardNaN(TinyModel):
    """A NaN in one element of rank 1's own shard of `net.0.bias` (rank 0 holds none of it)."""

    def on_after_backward(self):
        super().on_after_backward()
        if self.global_rank == 1 and self.trainer.global_step in POISON:
            dict(self.named_parameters())["net.0.bias"].grad.view(-1)[0] = float("nan")


class LocalProbe(Callback):
    """The batches that left this rank's own shards unchanged."""

    def __init__(self):
        self.unchanged = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if all(torch.equal(a, b) for a, b in zip(self.before, module.parameters())):
            self.unchanged.append(batch_idx)


plugin = AmpPlusFSDPPrecision("bf16-mixed", warn_skip_streak=2)
reporter = NaNSkipReporter(max_warnings=5)
probe = LocalProbe()
model = ShardNaN(lr=0.1)
trainer = Trainer(
    accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=[plugin], max_steps=6, logger=False,
    callbacks=[reporter, probe], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model)
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({
        "unchanged": probe.unchanged, "skipped": plugin.history.skipped_steps, "skips": reporter.skips,
        "numel": sum(p.numel() for p in model.parameters()),
    }, f)

from tests.helpers.sharded import leave  # noqa: E402

leave()
'''


@pytest.mark.slow
def test_fsdp1_bf16_nan_in_one_ranks_shard_is_skipped_by_every_rank(tmp_path):
    zero, one = run_script(FSDP1_BF16, tmp_path, timeout=240)  # 0.1.x: rank 0 stepped, rank 1 skipped, then a hang
    assert zero["numel"] > 0  # each rank holds its own shards
    assert one["numel"] > 0
    assert zero["unchanged"] == one["unchanged"] == [2, 3]  # neither rank applied its half on a poisoned step
    assert zero["skipped"] == one["skipped"] == [2, 3]
    assert [r["step"] for r in zero["skips"]] == [r["step"] for r in one["skips"]] == [2, 3]
    assert [o["name"] for o in zero["skips"][0]["offenders"]] == ["net.0.bias"]
    assert zero["_stderr"].count("2 optimizer updates in a row were skipped") == 1  # rank zero only


PLAIN_FUSED = r"""
import json, os, socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_amp_plus import ShardedDynamicLossScaler
from tests.helpers.sharded import leave

out = sys.argv[1]


def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scaler = ShardedDynamicLossScaler("cpu", init_scale=1024.0)
    scales, unchanged = [], []
    for step in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if rank == 1 and step == 1:
            model.weight.grad.view(-1)[0] = float("inf")
        scaler.step(opt)  # the fused path: torch checks without `unscale_`
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            unchanged.append(step)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"scales": scales, "unchanged": unchanged}, f)
    leave()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
"""


@pytest.mark.slow
def test_sharded_scaler_with_a_fused_optimizer_in_a_plain_loop_skips_on_every_rank(tmp_path):
    zero, one = run_script(PLAIN_FUSED, tmp_path, timeout=120)
    assert zero["unchanged"] == one["unchanged"] == [1]  # 0.1.x: rank 0 stepped at 1024, rank 1 skipped
    assert zero["scales"] == one["scales"] == [1024.0, 512.0, 512.0, 512.0]


@pytest.mark.slow
def test_a_packed_all_reduce_costs_fewer_collectives_and_bytes_than_torchmetrics_sync(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.helpers.sharded import ROOT, ended

    out = tmp_path / "cost.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "examples", "reduction_cost.py")
    done = subprocess.run(
        [sys.executable, script, "--params", "50", "--json", str(out)], env=env, capture_output=True, timeout=120
    )
    assert ended(done), (done.returncode, done.stderr[-3000:])  # torch's gloo abort at exit aside (pytorch#190489)
    result = json.loads(out.read_text())
    ours, theirs = result["ours"], result["torchmetrics"]
    assert ours["figures"] == theirs["figures"]  # the same sums and maximum on every rank
    assert ours["collectives"] == 3  # one per figure: offenders, underflow counts, largest gradient
    assert theirs["collectives"] > ours["collectives"]
    assert theirs["bytes_received"] >= 2 * ours["bytes_received"] - 8  # every state gathered from both ranks
