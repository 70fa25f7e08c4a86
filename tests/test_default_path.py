"""The default forensics stand alone: a fit with every callback at its defaults loads no opt-in module."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FIT = """
import json, sys
import torch
from torch import nn
from lightning.pytorch import LightningModule, Trainer
from lightning_amp_plus import (
    AmpAdvisor, AmpPlusPrecision, GradUnderflowMonitor, LossScaleMonitor, NaNSkipReporter, PrecisionReport,
)


class Loud(LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.big = nn.Linear(8, 8)
        with torch.no_grad():
            self.big.weight.fill_(1e4)  # its float16 output overflows: skips born in forward, the watch names it

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.big(self.body(x) + 10).float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 8))
        return torch.utils.data.DataLoader(data, batch_size=4)


reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
callbacks = [LossScaleMonitor(), reporter, GradUnderflowMonitor(), PrecisionReport(print_table=False)]
callbacks.append(AmpAdvisor(print_advice=False))
plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, auto_islands=sys.argv[1] == "auto")
Trainer(accelerator="cpu", plugins=[plugin], callbacks=callbacks, max_steps=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(Loud())
print(json.dumps({
    "origins": [r["origin"].get("module") for r in reporter.skips],
    "loaded": sorted(m for m in sys.modules if m.startswith("lightning_amp_plus.forensics.opt_in")),
    "forensics": sorted(m for m in sys.modules if m.startswith("lightning_amp_plus.forensics")),
}))
"""


def _fit(mode):
    done = subprocess.run(
        [sys.executable, "-c", _FIT, mode],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_default_fit_with_a_forward_born_skip_loads_no_opt_in_module():
    seen = _fit("default")
    assert seen["origins"][1:3] == ["big", "big"]  # the watch ran and named the module: the default path worked
    assert seen["loaded"] == []  # no replay, rerun or sandbox: nothing that runs your code again was even loaded
    assert "lightning_amp_plus.forensics.observe" in seen["forensics"]


def test_auto_islands_load_no_opt_in_module_either():
    seen = _fit("auto")
    assert seen["origins"][1] == "big"
    assert seen["loaded"] == []
