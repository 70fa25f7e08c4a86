"""Scale fixes pasted as printed, measured on real CPU float16 fits (issue 52.4): hysteresis, max_scale, growth.

Each test runs a fit that has the problem, takes the advisor's first fix as printed, runs it, and measures that the
fix changed what the advice said was wrong. The other fixes' pairs live beside their rules' tests
(`tests/test_origins.py`, `tests/callbacks/test_advisor.py`, `tests/test_real_models.py`, ...).
"""

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, GradUnderflowMonitor
from tests.helpers.trainer import make_trainer

SPIKES = (10, 22, 34, 46)


class Spread(LightningModule):
    """One Linear whose weight gradients spread over 20 octaves, times ``factor``: float16 loses the smallest ones,
    more of them at a lower scale. ``spikes``: one gradient element is inf at those steps (no scale causes it)."""

    def __init__(self, factor, spikes=()):
        super().__init__()
        self.lin = nn.Linear(20, 1, bias=False)
        self.factor, self.spikes = factor, spikes

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).float().sum() * self.factor

    def on_after_backward(self):
        if self.trainer.global_step in self.spikes:
            self.lin.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(plugin, model, steps, exact=False):
    torch.manual_seed(0)
    x = (2.0 ** -torch.arange(20.0)).repeat(steps, 1)
    advisor = AmpAdvisor(print_advice=False)
    monitor = GradUnderflowMonitor(every_n_steps=1, exact=exact)
    make_trainer(plugins=[plugin], callbacks=[monitor, advisor], max_steps=steps).fit(
        model, DataLoader(TensorDataset(x), batch_size=1)
    )
    return advisor, monitor


def _pasted(advice):
    return eval(advice.fix.split("  #")[0], {"AmpPlusPrecision": AmpPlusPrecision})


def _lost(monitor, below=None):
    values = [m["underflow_fraction"] for m in monitor.measurements if below is None or m["scale"] < below]
    return sum(values) / len(values) if values else None


def test_hysteresis_pasted_keeps_the_scale_at_max_scale_through_isolated_spikes():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, max_scale=2.0**10, growth_interval=4)
    advisor, monitor = _fit(plugin, Spread(2.0**-20, SPIKES), 56)
    (advice,) = [a for a in advisor.advice if a.code == "hysteresis"]
    assert advice.evidence["isolated_overflows"] == list(SPIKES)
    assert [v for _, v in plugin.history.curve()].count(2.0**9) == len(SPIKES)  # each spike halved the scale
    assert _lost(monitor, below=2.0**10) > 0.05  # and gradient was lost at the halved scale
    fixed = _pasted(advice)
    assert fixed.scaler.hysteresis == 2
    again, monitor = _fit(fixed, Spread(2.0**-20, SPIKES), 56)
    assert fixed.history.skipped_steps == list(SPIKES)  # the spikes still skip (no scale causes them) ...
    assert fixed.history.curve() == [(0, 2.0**10)]  # ... but the scale is never halved
    assert _lost(monitor, below=2.0**10) is None  # no update ran below the cap
    assert "hysteresis" not in [a.code for a in again.advice]


def test_max_scale_pasted_lifts_the_cap_to_the_scale_the_reference_fits_and_the_underflow_ends():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, max_scale=2.0**10)
    advisor, monitor = _fit(plugin, Spread(2.0**-30), 20, exact=True)
    assert advisor.advice[0].code == "max_scale"
    lost = _lost(monitor)
    assert lost > 0.5
    fixed = _pasted(advisor.advice[0])
    assert fixed.scaler.max_scale > 2.0**10
    again, monitor = _fit(fixed, Spread(2.0**-30), 20, exact=True)
    assert fixed.history.num_skipped == 0  # the scale the reference found fits: no overflow
    assert _lost(monitor) < 0.05 < lost  # measured: what float16 lost is gone
    assert again.advice == []


def test_growth_interval_pasted_grows_the_scale_back_within_the_run_and_less_is_lost():
    """One spike at step 5 backs the scale off past its calibration; growth_interval=2000 never grows it back in this
    run while float16 loses gradient at the lower scale. The printed interval, pasted, grows it back."""
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, max_scale=2.0**10)
    advisor, monitor = _fit(plugin, Spread(2.0**-20, (5,)), 64)
    (advice,) = [a for a in advisor.advice if a.code == "growth_interval"]
    assert plugin.history.curve() == [(0, 2.0**10), (6, 2.0**9)]  # never grew back
    assert _lost(monitor, below=2.0**10) > 0.05
    below = sum(m["scale"] < 2.0**10 for m in monitor.measurements)  # updates at the lower scale
    fixed = _pasted(advice)
    assert fixed.scaler.knobs()["growth_interval"] < 2000
    again, monitor = _fit(fixed, Spread(2.0**-20, (5,)), 64)
    assert fixed.history.skipped_steps == [5]  # the spike still skips
    assert fixed.history.curve()[-1][1] == 2.0**10  # grown back to the cap within the run
    assert 2 * sum(m["scale"] < 2.0**10 for m in monitor.measurements) < below  # measured: under half as many
    assert "growth_interval" not in [a.code for a in again.advice]
