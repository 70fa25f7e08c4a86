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
    with tempfile.TemporaryDirectory() as log_dir:
        return _count_fit(model, plugin, callbacks, steps, log_dir, trainer_kwargs)


def _count_fit(model, plugin, callbacks, steps, log_dir, trainer_kwargs):
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=list(callbacks),
        max_steps=steps,
        log_every_n_steps=INTERVAL,
        logger=CSVLogger(log_dir),  # a real logger: the monitor's logging path is counted too
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


# CUDA's copies and events, on a CPU: fake CUDA tensors (torch's FakeTensorMode needs no device) and a fake event


class FakeEvent:
    """`torch.cuda.Event`'s host side: recorded, done when the test says so, waited on by `synchronize`."""

    made: list["FakeEvent"] = []

    def __init__(self):
        self.recorded = self.waits = 0
        self.done = False
        FakeEvent.made.append(self)

    def record(self):
        self.recorded += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True


@pytest.fixture
def fake_event(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return FakeEvent.made


def test_a_device_to_host_copy_is_a_sync_and_no_other_copy_is():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        device = torch.empty(3, device="cuda")
        host = torch.empty(3)
        ops = {
            "to the host": lambda: device.to("cpu"),
            "copied into host memory": lambda: host.copy_(device),
            "cast on the device": lambda: device.to(torch.float16),
            "host to device": lambda: host.to("cuda:0"),
            "cast on the host": lambda: host.to(torch.float64),
            "host into host": lambda: host.copy_(host),
        }
        counts, devices = {}, {}
        for name, op in ops.items():
            with HostSyncCounter() as counter:
                devices[name] = op().device.type
            counts[name] = counter.count
        with HostSyncCounter() as together:
            for op in ops.values():
                op()
    assert counts == {name: int(name in ("to the host", "copied into host memory")) for name in ops}
    assert together.count == 2  # each one counted
    assert devices == {name: "cuda" if "device" in name else "cpu" for name in ops}  # each op's own result


def test_a_peek_on_cuda_copies_without_blocking_and_waits_only_when_asked(fake_event):
    from lightning_amp_plus.syncs import FlagPeek

    class OnCuda:  # what FlagPeek touches of a CUDA tensor
        device = torch.device("cuda", 0)

        def __init__(self, value):
            self.value, self.copies = value, []

        def detach(self):
            return self

        def to(self, *args, **kwargs):
            self.copies.append((args, kwargs))
            return torch.tensor([self.value])

    flag = OnCuda(3.0)
    with HostSyncCounter() as counter:
        busy = FlagPeek(flag)
        assert flag.copies == [(("cpu",), {"non_blocking": True})]
        assert [event.recorded for event in fake_event] == [1]  # after the copy was queued
        assert busy.value() is None  # the device is still busy: no answer, and no wait
        assert (counter.count, fake_event[0].waits) == (0, 0)
        fake_event[0].done = True
        assert busy.value() == 3.0  # done: read from host memory, no wait
        assert busy.value(wait=True) == 3.0  # nothing left to wait for
        assert (counter.count, fake_event[0].waits) == (0, 0)
        float(torch.ones(()))  # a sync of the user's own
        waited = FlagPeek(OnCuda(0.0))
        assert waited.value(wait=True) == 0.0
        assert (counter.count, fake_event[1].waits) == (2, 1)  # the wait is one more host sync


def test_a_peek_is_no_sync_and_the_counter_counts_again_after_it(fake_event):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_amp_plus.syncs import FlagPeek

    with FakeTensorMode():
        flag = torch.zeros((), device="cuda")
        with HostSyncCounter() as counter:
            peek = FlagPeek(flag)
            assert counter.count == 0  # its device-to-host copy does not block
            assert peek._copy.device.type == "cpu"  # the copy it made is on the host (its arguments reached it)
            flag.to("cpu")
            assert counter.count == 1  # a plain copy after it still does


class _ClippedManually(QuietModel):
    """Manual optimization: two optimizers, each clipped right before its step (``clip``: 0 clips nothing)."""

    def __init__(self, clip):
        super().__init__(lr=1e-3)
        self.automatic_optimization = False
        self.head = torch.nn.Linear(1, 1)
        self.clip = clip

    def training_step(self, batch, batch_idx):
        a, b = self.optimizers()
        x, y = batch
        a.zero_grad()
        b.zero_grad()
        self.manual_backward(torch.nn.functional.mse_loss(self.head(self(x)).float(), y))
        for opt in (a, b):
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=1e-3), torch.optim.SGD(self.head.parameters(), lr=1e-3)


def test_manual_clipping_reads_the_skip_its_step_reads_once():
    """A clip reads whether its step is skipped (a skipped step is not clipped: its inf is told as inf), the read the
    step makes, kept for it: clipping adds no sync. (A clip of an optimizer that does not step is warned of; it
    costs that one read: the performance page.)"""

    def count(clip):
        with tempfile.TemporaryDirectory() as log_dir:
            plugin = AmpPlusPrecision("16-mixed", init_scale=2.0, growth_interval=10**6)  # no skip either way
            return _count_fit(_ClippedManually(clip), plugin, (), STEPS, log_dir, {})

    assert count(1.0) == count(0.0)
