"""A fused optimizer's run reports, stops and is advised as the same run with a plain optimizer (issue 54, defect 3).

Fault injection by forward overflow: from ``start`` on, ``boom`` multiplies by 1e5, so float16 overflows in its
forward at every step and the scale backs off to ``min_scale``, where the reporter stops the fit.
"""

import json

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, LossScaleMonitor, NaNSkipReporter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Boom(nn.Module):
    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5 if self.step >= self.start else x


class ForwardOverflow(TinyModel):
    """Linear -> ``boom`` -> ReLU -> Linear head, MSE loss; Adam, fused or not."""

    def __init__(self, fused: bool, start: int = 3) -> None:
        super().__init__(lr=1e-3)
        self.fused = fused
        self.boom = Boom(start)
        self.net = nn.Sequential(nn.Linear(8, 16), self.boom, nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        self.boom.step = self.trainer.global_step
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.fused)


def run(tmp_path, fused: bool) -> dict:
    """One fit to its collapse: what the report, the history, the error and the advisor say."""
    plugin = AmpPlusPrecision("16-mixed", device="cpu", init_scale=2.0**6)
    path = tmp_path / f"skips_{fused}.json"
    reporter = NaNSkipReporter(report_path=path, max_warnings=0)
    advisor = AmpAdvisor(print_advice=False)
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=[reporter, advisor, LossScaleMonitor()],
        logger=CSVLogger(tmp_path / f"logs_{fused}"),
        max_steps=40,
        log_every_n_steps=16,
    )
    with pytest.raises(LossScaleCollapseError) as error:
        trainer.fit(ForwardOverflow(fused))
    report = json.loads(path.read_text())
    return {
        "history": plugin.history.skipped_steps,
        "recorded": report["skipped_steps"],
        "origins": [r["origin"] is not None for r in report["skips"]],
        "updates": plugin.history.num_steps,
        "error": str(error.value).split(";")[0],
        "advice": [a.code for a in advisor.advice],
    }


def test_a_fused_optimizer_collapses_at_the_same_step_with_the_same_report_and_advice(tmp_path):
    plain, fused = run(tmp_path, fused=False), run(tmp_path, fused=True)
    assert "step 9 overflowed while the loss scale already sat at min_scale=1" in plain["error"]
    assert plain["updates"] == 10  # stopped at the skip that found the scale at its floor
    assert fused == plain  # not at the next logging step (15), with skips after the collapse left out of the report
    assert plain["recorded"] == plain["history"] == list(range(3, 10))
    assert all(plain["origins"][1:])  # each skip's origin told (the first, read from the loss, starts the watch)
    assert plain["advice"] == ["fp32_module"]  # never `backward_skips` for skips whose origin went untold
