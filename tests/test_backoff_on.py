"""``AmpPlusPrecision(backoff_on="backward")``: a skip the loss scale did not cause does not move it (issue 52).

A skip whose loss already held inf/nan before scaling (the batch, the forward, the loss) is skipped and told as
always; the scale and its trackers are left alone. A skip born in backward backs off as always. Each case is a real
fit with faults injected: a NaN loss (``poison``), an inf in one parameter's gradient (``grad_poison``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.syncs import HostSyncCounter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


def _fit(backoff_on, steps=12, callbacks=(), model=None, **knobs):
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", backoff_on=backoff_on, **{"init_scale": 2.0**12, **knobs})
    model = model or TinyModel(poison={s: "nan" for s in range(0, steps, 4)}, grad_poison={6: "net.0.weight"})
    make_trainer(plugins=[plugin], callbacks=list(callbacks), max_steps=steps).fit(model)
    return plugin, model


def test_a_loss_born_skip_leaves_the_scale_and_a_backward_born_one_backs_off():
    torchs, _ = _fit("any", growth_interval=1000)
    ours, _ = _fit("backward", growth_interval=1000)
    assert torchs.history.skipped_steps == ours.history.skipped_steps == [0, 4, 6, 8]  # skipped all the same
    assert torchs.history.curve() == [(0, 4096.0), (1, 2048.0), (5, 1024.0), (7, 512.0), (9, 256.0)]
    assert ours.history.curve() == [(0, 4096.0), (7, 2048.0)]  # only step 6's gradient overflow backs off


def test_a_loss_born_skip_neither_resets_nor_counts_toward_growth():
    model = TinyModel(poison={2: "nan"})
    torchs, _ = _fit("any", model=model, growth_interval=3)
    ours, _ = _fit("backward", model=TinyModel(poison={2: "nan"}), growth_interval=3)
    assert torchs.history.curve()[:3] == [(0, 4096.0), (3, 2048.0), (6, 4096.0)]  # reset at 2, grown after 3-5
    assert ours.history.curve()[:2] == [(0, 4096.0), (4, 8192.0)]  # 0, 1 and 3 clean: grown at 3's update


def test_a_skipped_step_leaves_the_weights_as_they_were():
    class Recording(TinyModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after = getattr(self, "after", []) + [[p.detach().clone() for p in self.parameters()]]

    _, model = _fit("backward", model=Recording(poison={3: "nan"}))
    assert all(torch.equal(a, b) for a, b in zip(model.after[2], model.after[3], strict=True))


def test_a_nan_loss_in_any_micro_batch_of_an_accumulated_update_leaves_the_scale():
    class Micro(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == 4 else loss  # the first micro-batch of update 2

    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12, growth_interval=1000, backoff_on="backward")
    make_trainer(plugins=[plugin], max_steps=4, accumulate_grad_batches=2).fit(Micro())
    assert plugin.history.skipped_steps == [2]
    assert plugin.history.curve() == [(0, 4096.0)]


def test_bad_batches_that_collapse_torchs_rule_train_under_backward():
    """A corrupt sample in every 4th batch: torch's rule walks the scale to its floor and the collapse check stops
    the fit; with backoff_on="backward" it trains to its end."""
    poison = {s: "nan" for s in range(1, 80, 4)}
    with pytest.raises(LossScaleCollapseError):
        _fit(
            "any", steps=80, callbacks=[NaNSkipReporter(max_warnings=0)], model=TinyModel(poison=poison), min_scale=1.0
        )
    plugin, _ = _fit(
        "backward", steps=80, callbacks=[NaNSkipReporter(max_warnings=0)], model=TinyModel(poison=poison), min_scale=1.0
    )
    assert plugin.history.num_steps == 80
    assert plugin.scaler.get_scale() >= 2.0**12  # never backed off by the batches


def test_it_adds_no_host_sync_on_clean_steps():
    def syncs(backoff_on):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        plugin = AmpPlusPrecision("16-mixed", init_scale=16.0, backoff_on=backoff_on)  # no skip
        engine = plugin._engine
        engine.scaler.set_device_type("cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with HostSyncCounter() as counter:
            for _ in range(5):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(8, 4)).float().sum()
                engine.scale(loss).backward()
                engine.scaler.step(optimizer)
                engine.scaler.update()
                optimizer.zero_grad()
        return counter.count

    assert syncs("backward") == syncs("any")
    # after a skip, the growth tracker's value is the device's (reset, or kept for a loss-born one): read once then


def test_bad_input_names_the_argument_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"backoff_on='sometimes'.*'any', 'backward'"):
        AmpPlusPrecision("16-mixed", backoff_on="sometimes")
    with pytest.raises(ValueError, match="bf16-mixed has no loss scale to back off"):
        AmpPlusPrecision("bf16-mixed", backoff_on="backward")


def test_the_skip_line_says_why_the_scale_was_kept(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        _fit(
            "backward",
            steps=6,
            callbacks=[NaNSkipReporter(max_consecutive_skips=None)],
            model=TinyModel(poison={2: "nan"}),
        )
    (line,) = [r.getMessage() for r in caplog.records if "step 2 skipped" in r.getMessage()]
    assert line.endswith("loss scale 4096 -> 4096 (kept: the loss already held inf/nan; backoff_on='backward')")


def test_an_applied_update_whose_loss_held_inf_counts_as_clean_as_under_torchs_rule():
    """A loss plus a constant inf has finite gradients: the update is applied; it counts toward growth, every time."""

    class InfConstant(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + torch.tensor(float("inf")) if self.trainer.global_step in (1, 3, 5, 6, 7) else loss

    curves = {}
    for mode in ("any", "backward"):
        plugin, _ = _fit(mode, steps=9, model=InfConstant(), growth_interval=2)
        assert plugin.history.skipped_steps == []
        curves[mode] = plugin.history.curve()
    assert curves["backward"] == curves["any"]
