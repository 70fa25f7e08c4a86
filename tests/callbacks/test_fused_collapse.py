"""A fused optimizer's run reports, stops and is advised as the same run with a plain optimizer (issue 54, defect 3).

Fault injection by forward overflow: from ``start`` on, ``boom`` multiplies by 1e5, so float16 overflows in its
forward at every step and the scale backs off to ``min_scale``, where the reporter stops the fit.
"""

import json

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_amp_plus import (
    AmpAdvisor,
    AmpPlusPrecision,
    LossScaleCollapseError,
    LossScaleMonitor,
    NaNSkipReporter,
    syncs,
)
from lightning_amp_plus.callbacks._device_probe import DeviceSkipProbe
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


def run(tmp_path, fused: bool, monitor_first: bool = False, log_every: int = 16, **reporter_args) -> dict:
    """One fit to its collapse: what the report, the history, the error and the advisor say.

    ``monitor_first``: `LossScaleMonitor` before the reporter (it reads the history at a logging step first).
    """
    plugin = AmpPlusPrecision("16-mixed", device="cpu", init_scale=2.0**6)
    path = tmp_path / f"skips_{fused}.json"
    reporter = NaNSkipReporter(report_path=path, max_warnings=0, **reporter_args)
    advisor = AmpAdvisor(print_advice=False)
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), reporter, advisor] if monitor_first else [reporter, advisor, LossScaleMonitor()],
        logger=CSVLogger(tmp_path / f"logs_{fused}"),
        max_steps=40,
        log_every_n_steps=log_every,
    )
    with pytest.raises(LossScaleCollapseError) as error:
        trainer.fit(ForwardOverflow(fused))
    report = json.loads(path.read_text())
    return {
        "history": plugin.history.skipped_steps,
        "recorded": report["skipped_steps"],
        "origins": [r["origin"] is not None for r in report["skips"]],
        "losses": [r["loss"] for r in report["skips"]],
        "offenders": [bool(r["offenders"]) for r in report["skips"]],
        "updates": plugin.history.num_steps,
        "error": str(error.value).split(";")[0],
        "advice": [a.code for a in advisor.advice],
    }


@pytest.fixture
def late_flags(monkeypatch):
    """A fused skip's flag that reaches the host only when waited for (a GPU whose copy is slow): it is read at the
    logging step, several skips at once."""
    value = syncs.FlagPeek.value
    monkeypatch.setattr(syncs.FlagPeek, "value", lambda self, wait=False: value(self, wait) if wait else None)


def test_a_fused_optimizer_collapses_at_the_same_step_with_the_same_report_and_advice(tmp_path):
    plain, fused = run(tmp_path, fused=False), run(tmp_path, fused=True)
    assert None not in fused.pop("losses") + plain.pop("losses")  # inf here may be nan there (fused Adam's rounding)
    assert "step 9 overflowed while the loss scale already sat at min_scale=1" in plain["error"]
    assert plain["updates"] == 10  # stopped at the skip that found the scale at its floor
    assert fused == plain  # not at the next logging step (15), with skips after the collapse left out of the report
    assert plain["recorded"] == plain["history"] == list(range(3, 10))
    assert all(plain["origins"][1:])  # each skip's origin told (the first, read from the loss, starts the watch)
    assert plain["advice"] == ["fp32_module"]  # never `backward_skips` for skips whose origin went untold


@pytest.mark.parametrize("log_every", [1, 5])
def test_a_fused_skip_on_a_logging_step_keeps_its_origin_loss_and_offenders(tmp_path, log_every):
    """`LossScaleMonitor` listed first reads the history at each logging step: a fused skip there is known on the host
    before the reporter holds its flag. Its record keeps what the step can tell (break pass on issue 54)."""
    plain = run(tmp_path, fused=False, monitor_first=True, log_every=log_every)
    fused = run(tmp_path, fused=True, monitor_first=True, log_every=log_every)
    assert all(loss in ("inf", "-inf", "nan") for loss in fused.pop("losses") + plain.pop("losses"))
    assert fused == plain  # its losses aside: fused Adam's rounding differs, so inf here is nan there
    assert all(plain["origins"][1:])
    assert all(plain["offenders"])


def test_a_collapse_found_late_keeps_every_skip_and_origin_it_collected(tmp_path, late_flags):
    fused = run(tmp_path, fused=True)
    assert "step 9 overflowed while the loss scale already sat at min_scale=1" in fused["error"]
    assert fused["updates"] == 16  # its flags were read at the logging step (15): six skips after the collapse
    assert fused["recorded"] == fused["history"] == list(range(3, 16))  # the report holds every skip the run made


def test_a_collapse_among_skips_collected_together_keeps_the_origin_of_those_after_it(tmp_path, monkeypatch):
    """Step 7's flag reaches the host only when waited for, and step 8's replaces it in the probe: both are collected
    when step 8's is read, step 7 the collapse (five in a row). Step 8's origin, told as its flag was read, is kept."""
    hold = DeviceSkipProbe.hold

    class Late:
        def __init__(self, peek):
            self.peek = peek

        def value(self, wait=False):
            return self.peek.value(wait) if wait else None

    def late_at_7(self, history, calls):
        hold(self, history, calls)
        if self.held is not None and self.held[0] == 7:
            step, peek, calls = self.held
            self.held = (step, Late(peek), calls)

    monkeypatch.setattr(DeviceSkipProbe, "hold", late_at_7)
    fused = run(tmp_path, fused=True, max_consecutive_skips=5)
    assert "5 consecutive optimizer steps were skipped" in fused["error"]
    assert fused["recorded"] == fused["history"] == [3, 4, 5, 6, 7, 8]
    assert fused["origins"] == [True, True, True, True, False, True]  # 7's flag was never read in time
