"""The sync budget: our bookkeeping adds no host sync per step beyond what stock Lightning AMP needs."""

import math
import tempfile

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter
from lightning_amp_plus.syncs import HostSyncCounter
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer

STEPS = 24
INTERVAL = 8


class QuietModel(TinyModel):
    """No per-step `.item()` of its own, no hooks that copy gradients."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        pass

    def train_dataloader(self):
        return make_loader(n=4 * 2 * STEPS)  # one epoch covers every run here


def count_syncs(plugin, callbacks=(), optimizer="sgd", steps=STEPS, **trainer_kwargs):
    """Host syncs of a whole fit, less Lightning's fixed set-up and tear-down ones (a fit of 0 steps' worth)."""
    model = QuietModel(optimizer=optimizer, lr=1e-3)
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=list(callbacks),
        max_steps=steps,
        log_every_n_steps=INTERVAL,
        logger=CSVLogger(tempfile.mkdtemp()),  # a real logger: the monitor's logging path is counted too
        **trainer_kwargs,
    )
    with HostSyncCounter() as counter:
        trainer.fit(model)
    return counter.count - FIXED


FIXED = 0


@pytest.fixture(autouse=True, scope="module")
def _fixed_overhead():
    """Lightning's own syncs per fit that do not depend on the step count (measured with a stock 1-step fit)."""
    global FIXED
    FIXED = 0
    one = count_syncs(stock("bf16-mixed"), steps=1)
    two = count_syncs(stock("bf16-mixed"), steps=2)
    assert one == two  # stock bf16 costs nothing per step
    FIXED = one


def ours(precision="16-mixed", **kwargs):
    return AmpPlusPrecision(precision, init_scale=1024.0, **kwargs)


def stock(precision="16-mixed"):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "16-mixed" else None
    return MixedPrecision(precision, "cpu", scaler=scaler)


def callbacks():
    return [LossScaleMonitor(), NaNSkipReporter()]


LOG_POINTS = math.ceil(STEPS / INTERVAL) + 1  # one flush per logging interval, and one at the end


def test_stock_baseline_is_one_sync_per_step_with_sgd():
    assert count_syncs(stock()) == STEPS


def test_non_fused_sgd_with_clipping():
    baseline = count_syncs(stock(), gradient_clip_val=1.0)
    assert baseline == STEPS
    assert count_syncs(ours(), callbacks(), gradient_clip_val=1.0) <= baseline + LOG_POINTS


def test_fused_adamw_with_clipping_is_sync_free_per_step():
    baseline = count_syncs(stock(), optimizer="fused_adamw")  # stock refuses clipping with a fused optimizer
    assert baseline == 0
    # + 1: the first step creates the optimizer's state, and its flag is read once (a skipped first step must take
    # that state back out: fused kernels create it even when they skip)
    assert count_syncs(ours(), callbacks(), optimizer="fused_adamw", gradient_clip_val=1.0) <= LOG_POINTS + 1


def test_gradient_accumulation():
    baseline = count_syncs(stock(), accumulate_grad_batches=2)
    assert count_syncs(ours(), callbacks(), accumulate_grad_batches=2) <= baseline + LOG_POINTS


@pytest.mark.parametrize(("skip", "per_step"), [(True, 1), (False, 0)])
def test_bf16_skip_detection_costs_one_sync_per_step_only_when_on(skip, per_step):
    assert count_syncs(stock("bf16-mixed")) == 0
    count = count_syncs(AmpPlusPrecision("bf16-mixed", skip_nonfinite=skip), callbacks())
    assert per_step * STEPS <= count <= per_step * STEPS + LOG_POINTS


def test_bf16_fused_skip_detection_is_sync_free():
    count = count_syncs(AmpPlusPrecision("bf16-mixed"), callbacks(), optimizer="fused_adamw")
    assert count <= LOG_POINTS + 1  # + 1: the first step's state (see above)


def test_skip_aware_scheduler_with_fused_optimizer_costs_at_most_one_per_step():
    def sched(opt):
        return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)

    model = QuietModel(optimizer="fused_adamw", lr=1e-3, scheduler=sched)
    trainer = make_trainer(plugins=[ours()], max_steps=STEPS)
    with HostSyncCounter() as counter:
        trainer.fit(model)
    # reading the device skip flag once per step, for the scheduler only; plus the history's flush at the end
    assert STEPS <= counter.count - FIXED <= STEPS + 1


def test_the_counter_changes_no_result_and_leaves_no_registration_behind():
    from lightning_amp_plus import syncs

    x = torch.arange(4, dtype=torch.float32)
    with HostSyncCounter() as outer:
        with HostSyncCounter() as inner:
            wide = x.to(torch.float64)  # a copy with arguments: they reach the op
            into = torch.zeros(4, dtype=torch.float64).copy_(x)
            value = float(x.sum())
        assert [outer] == syncs._ACTIVE
    assert syncs._ACTIVE == []
    assert wide.dtype == torch.float64
    assert torch.equal(into, x.double())
    assert value == 6.0
    assert (inner.count, outer.count) == (1, 1)  # the one host read; CPU copies are no sync
