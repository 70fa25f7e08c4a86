"""The update cycle's rules against a reference and by their cost: the host-side fast path never changes an outcome."""

from __future__ import annotations

import csv
import pickle
import random
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_amp_plus import (
    AmpEngine,
    AmpPlusPrecision,
    AmpPlusWarning,
    DynamicLossScaler,
    LossScaleMonitor,
    NaNSkipReporter,
    SkipEvent,
)
from lightning_amp_plus.__main__ import main as cli
from lightning_amp_plus.scaler import NonFiniteChecker
from lightning_amp_plus.syncs import HostSyncCounter
from tests.helpers.listeners import listener
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer

LR = 0.1


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched in the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------ the scaler against torch's rule
def _fuzz(seed: int, make: Any) -> list[tuple[float, int]]:
    """Random cycles: plain, fused and unscaled-only optimizers, overflows, set_growth_interval, load, pickle."""
    rng = random.Random(seed)
    torch.manual_seed(0)
    models = [nn.Linear(2, 1) for _ in range(3)]
    opts = [
        torch.optim.SGD(models[0].parameters(), lr=0.0),
        torch.optim.SGD(models[1].parameters(), lr=0.0, fused=True),
        torch.optim.SGD(models[2].parameters(), lr=0.0),
    ]
    scaler = make()
    log = []
    for _ in range(40):
        op = rng.random()
        if op < 0.05:
            scaler.set_growth_interval(rng.randint(1, 5))
        elif op < 0.08:
            state = scaler.state_dict()
            keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
            scaler.load_state_dict({k: state[k] for k in keys})
        elif op < 0.11:
            scaler = pickle.loads(pickle.dumps(scaler))
        used = rng.sample(range(3), rng.randint(1, 3))
        loss = sum(models[i](torch.ones(1, 2)).sum() * (float("inf") if rng.random() < 0.2 else 1.0) for i in used)
        scaler.scale(loss).backward()
        unscale_only = rng.random() < 0.1 and len(used) > 1
        for j, i in enumerate(used):
            if unscale_only and j == 0:
                scaler.unscale_(opts[i])  # clipped, not stepped
            else:
                scaler.step(opts[i])
        if rng.random() < 0.05:
            scaler.update(new_scale=float(2 ** rng.randint(0, 20)))
        else:
            scaler.update()
        for o in opts:
            o.zero_grad()
        log.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return log


@pytest.mark.parametrize("seed", range(40))
def test_the_scalers_fast_path_follows_torchs_rule_exactly(seed):
    reference = _fuzz(seed, lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    ours = _fuzz(
        seed, lambda: DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3, min_scale=0.0, max_scale=1e38)
    )
    assert ours == reference


def _plain_cycle(scaler: DynamicLossScaler, model: nn.Module, opt: torch.optim.Optimizer, bad: bool = False) -> None:
    scaler.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
    scaler.step(opt)


def test_a_known_clean_update_below_the_interval_is_one_op_and_a_growth_runs_the_rule():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=3)
    counts = []
    for _ in range(6):
        _plain_cycle(scaler, model, opt)
        assert scaler.known_outcome() is False
        with OpCounter() as counter:
            scaler.update()
        counts.append((dict(counter.ops), scaler.scale_kept))
        opt.zero_grad()
    fast = ({"add_": 1}, True)
    recorded = ({"clone": 1, "add_": 1}, True)  # the scale copied once: the first, and after a change
    grow = counts[2]
    assert counts == [recorded, fast, grow, recorded, fast, grow]
    assert grow[0].get("_amp_update_scale_") == 1
    assert grow[1] is False  # the scale changed: the history must copy it
    assert scaler.get_scale() == 32.0


def test_after_a_cycle_the_host_could_not_decide_the_tracker_is_read_back_once():
    model = nn.Linear(2, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.0)
    fused = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.0, fused=True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=4)
    for opt in (fused, fused):  # the first fused step made state (read once); the second is decided on the device
        scaler.scale(sum(p.sum() for p in opt.param_groups[0]["params"]) * 1.0).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.known_outcome() is None
    reads = []
    for _ in range(3):
        _plain_cycle(scaler, model, plain)
        with HostSyncCounter() as counter:
            scaler.update()
        reads.append(counter.count)
        plain.zero_grad()
    assert reads == [1, 0, 0]  # one read of the tracker, then the host follows it again
    assert scaler.get_scale() == 16.0  # grew after 4 clean updates (2 fused + 2 plain), as torch's rule says


def test_a_tracker_above_a_lowered_interval_is_a_state_torch_writes_and_loads():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=10)
    for _ in range(5):
        _plain_cycle(scaler, model, opt)
        scaler.update()
    scaler.set_growth_interval(3)
    state = scaler.state_dict()
    assert state["_growth_tracker"] == 5
    fresh = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=3)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["_growth_tracker"] == 5
    reference = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10)
    reference.load_state_dict(state)
    assert fresh.state_dict()["scale"] == reference.state_dict()["scale"]


@pytest.mark.parametrize("setter", ["set_growth_factor", "set_backoff_factor"])
def test_the_setters_refuse_what_the_constructor_refuses(setter):
    scaler = DynamicLossScaler("cpu")
    value = 1 + 1e-12 if setter == "set_growth_factor" else 1 - 1e-12
    knob = setter[len("set_") :]
    with pytest.raises(ValueError, match=rf"`DynamicLossScaler.{setter}\({knob}=.*float32 rounds it to 1.0"):
        getattr(scaler, setter)(value)
    with pytest.raises(ValueError, match=r"set_growth_interval\(growth_interval=0\)` is invalid"):
        scaler.set_growth_interval(0)


def test_reset_gives_the_constructors_state_back():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=2)
    for bad in (True, True, False, False):
        _plain_cycle(scaler, model, opt, bad)
        scaler.update()
        opt.zero_grad()
    scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 7})
    scaler.reset()
    assert scaler.scale_kept is False
    assert scaler.get_growth_interval() == 2
    _plain_cycle(scaler, model, opt)
    assert scaler.get_scale() == 8.0
    assert scaler.state_dict()["_hysteresis_tracker"] == 2


# ------------------------------------------------------------------------------ fused state on a skipped first step
@pytest.mark.parametrize("checker", ["scaler", "bf16"])
def test_a_skipped_first_fused_step_leaves_no_optimizer_state(checker):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, fused=True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0) if checker == "scaler" else NonFiniteChecker()
    scaler.scale(model(torch.ones(1, 3)).sum() * float("inf")).backward()
    scaler.step(opt)
    assert scaler.step_was_skipped(opt) is True
    assert len(opt.state) == 0  # fused SGD made momentum buffers of uninitialised memory; they are taken out
    scaler.update()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    grads = [p.grad.detach() / scaler.get_scale() for p in model.parameters()]
    scaler.step(opt)
    for b, p, g in zip(before, model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.detach(), b - LR * g)  # a first step from a clean state


def test_a_trainer_with_fused_momentum_sgd_matches_the_non_fused_one_after_a_skipped_first_step():
    def run(fused: bool) -> list[torch.Tensor]:
        class Momentum(TinyModel):
            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, fused=fused)

        torch.manual_seed(0)
        model = Momentum(poison={0: "inf"})
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**10)], max_steps=6).fit(model)
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------ the engine's cycle
def _engine_cycle(engine: AmpEngine, model: nn.Module, opt: torch.optim.Optimizer, step: Any, bad: bool = False):
    engine.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
    engine.begin(opt, step)
    engine.unscale(opt)
    engine.step(opt)


def test_a_known_clean_update_records_with_no_device_op_of_its_own():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0, growth_interval=100))
    counts = []
    for step in range(5):
        _engine_cycle(engine, model, opt, step, bad=step == 2)
        with OpCounter() as counter:
            engine.end_cycle()
        counts.append(dict(counter.ops))
        opt.zero_grad()
    assert counts[1] == counts[4] == {"add_": 1}  # the tracker's increment; the history took no copy
    assert counts[0].get("clone") == counts[3].get("clone") == 1  # the first record, and the one after a backoff
    assert engine.history.curve() == [(0, 8.0), (3, 4.0)]
    assert engine.history.skipped_steps == [2]
    assert engine.skip_known_on_host


def test_the_engine_opens_an_update_itself_when_the_caller_did_not():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    for _ in range(2):
        engine.scale(model(torch.ones(1, 2)).sum()).backward()
        engine.unscale(opt)  # no begin
        engine.step(opt)
        engine.end_cycle()
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.step(opt)  # no begin, no unscale
    engine.end_cycle()
    assert engine.history.num_steps == 3
    assert engine.history.last_step == 2


def test_new_gradients_are_those_of_a_backward_after_the_optimizers_last_step():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    assert not engine.has_new_gradients(opt)
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    assert engine.has_new_gradients(opt)
    assert engine.has_new_gradients(other)
    engine.begin(opt, 0)
    engine.step(opt)
    assert not engine.has_new_gradients(opt)
    assert engine.has_new_gradients(other)


def test_bf16_abort_without_the_check_and_skip_events_at_scale_one():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    unchecked = AmpEngine("bf16-mixed", None, skip_nonfinite=False)
    unchecked.scale(model(torch.ones(1, 2)).sum()).backward()
    unchecked.begin(opt, 0)
    unchecked.step(opt)
    unchecked.abort_cycle()  # records what stepped, never raises
    assert unchecked.history.num_steps == 1
    assert unchecked.step_was_skipped(opt) is False

    events: list[SkipEvent] = []
    engine = AmpEngine("bf16-mixed", None)
    engine.listen(listener(update_skipped=events.append))
    for step in range(3):
        _engine_cycle(engine, model, opt, step, bad=step > 0)
        engine.end_cycle()
        opt.zero_grad()
    assert [(e.step, e.scale, e.new_scale, e.consecutive) for e in events] == [(1, 1.0, 1.0, 1), (2, 1.0, 1.0, 2)]
    assert engine.optimizer_step_was_skipped


def test_the_streak_warning_is_re_armed_by_a_clean_update_and_says_no_scale_in_bf16():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("bf16-mixed", None, warn_skip_streak=2)
    pattern = [True, True, True, False, True, True]

    def run() -> None:
        for step, bad in enumerate(pattern):
            _engine_cycle(engine, model, opt, step, bad=bad)
            engine.end_cycle()
            opt.zero_grad()

    with pytest.warns(AmpPlusWarning) as caught:
        run()
    messages = [str(w.message) for w in caught if "in a row" in str(w.message)]
    assert len(messages) == 2  # once per streak, not at every skip past the threshold
    assert messages[0].startswith("2 optimizer updates in a row were skipped (inf/nan gradients): the weights")


# ------------------------------------------------------------------------------ one optimizer stepping twice in a batch
class TwoStepsPerBatch(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = nn.Linear(8, 1)
        self.ratios: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        plugin = self.trainer.precision_plugin
        for _ in range(2):
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.lin(x).float(), y))
            true = self.lin.weight.grad.detach() / plugin.loss_scale  # the scale this backward used
            before = self.lin.weight.detach().clone()
            opt.step()
            self.ratios.append(float((self.lin.weight.detach() - before).norm() / (LR * true).norm()))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        return make_loader()


def test_one_optimizer_stepping_twice_in_a_batch_applies_exact_updates_across_a_scale_change():
    model = TwoStepsPerBatch()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    make_trainer(plugins=[plugin], max_steps=6).fit(model)
    assert plugin.history.curve()[:3] == [(0, 256.0), (1, 512.0), (2, 1024.0)]  # a new scale every update
    assert model.ratios == pytest.approx([1.0] * 6, rel=1e-5)  # 0.1.x: every second update was half its size


# ------------------------------------------------------------------------------ reporter, monitor, plot, reuse
class MixedGAN(LightningModule):
    """A fused and a plain optimizer; `bad` maps a batch to the one whose loss overflows."""

    def __init__(self, bad: dict[int, str]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1)
        self.bad = bad

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_d, opt_g = self.optimizers()
        x = batch[0]
        which = self.bad.get(batch_idx)
        loss_d = self.d(x).float().sum() * (float("inf") if which == "d" else 1.0)
        loss_g = self.g(x).float().sum() * (float("inf") if which == "g" else 1.0)
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.d.parameters(), lr=1e-3, fused=True),
            torch.optim.SGD(self.g.parameters(), lr=1e-3),
        )

    def train_dataloader(self) -> Any:
        return make_loader()


def test_a_device_decided_skip_right_before_a_host_known_one_is_reported_first():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=12).fit(MixedGAN({3: "d", 4: "g"}))
    assert plugin.history.skipped_steps == [3, 4]
    assert reporter.skipped_steps == [3, 4]
    assert [r["step"] for r in reporter.skips] == [3, 4]
    assert reporter.state_dict()["consecutive"] == 2


def test_the_stock_plugins_sampled_scale_lands_on_the_update_it_belongs_to_with_accumulation(tmp_path):
    class Logged(TinyModel):
        used: dict[int, float] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
            self.used[step] = self.trainer.precision_plugin.scaler.get_scale()

    model = Logged()
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1))
    logger = CSVLogger(tmp_path)
    make_trainer(
        plugins=[stock],
        callbacks=[LossScaleMonitor(logging_interval=1, progress_bar=False)],
        logger=logger,
        log_every_n_steps=1,
        accumulate_grad_batches=2,
        max_steps=4,
    ).fit(model)
    with open(logger.experiment.metrics_file_path, newline="") as f:
        rows = list(csv.DictReader(f))
    sampled = {int(r["step"]): float(r["amp/loss_scale"]) for r in rows if r.get("amp/loss_scale")}
    assert model.used == {0: 256.0, 1: 512.0, 2: 1024.0, 3: 2048.0}
    assert {s: v for s, v in sampled.items() if s in model.used} == model.used


@pytest.mark.parametrize("values", ["0,1e308\n5,1.7e308", "0,0\n5,-1"])
def test_plot_command_refuses_values_that_are_not_a_loss_scale(tmp_path, capsys, values):
    (tmp_path / "metrics.csv").write_text("step,amp/loss_scale\n" + values + "\n")
    assert cli(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: {tmp_path / 'metrics.csv'}: amp/loss_scale at step 0 is ")  # named
    assert "not a loss scale" in err[0]


def test_another_fit_of_the_same_trainer_continues_the_scale_and_the_history():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    reporter = NaNSkipReporter(max_warnings=0)
    model = TinyModel(poison={2: "inf", 20: "inf"})
    trainer = make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=-1, max_epochs=1)
    trainer.fit(model)
    first = plugin.history.num_steps
    scale = plugin.scaler.get_scale()
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model)
    assert plugin.history.num_steps == 2 * first  # continued, as Lightning's own counters do
    assert plugin.history.scale_at(first) == scale  # not init_scale again
    assert plugin.history.skipped_steps == [2, 20]
    assert reporter.skipped_steps == [2, 20]


def test_a_closure_whose_loss_is_nan_with_finite_gradients_is_skipped_and_a_second_step_in_a_cycle_is_refused():
    model = nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)
    checker = NonFiniteChecker()
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        checker.scale(loss).backward()
        return loss.detach() * float("nan")  # finite gradients, a non-finite loss

    checker.step(opt, closure)
    assert checker.step_was_skipped(opt) is True
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        checker.step(opt, closure=closure)
    checker.update()

    def clean() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        checker.scale(loss).backward()
        return loss

    checker.step(opt, closure=clean)
    assert checker.step_was_skipped(opt) is False
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_closure_step_checks_in_float32_whatever_the_default_dtype():
    torch.set_default_dtype(torch.float64)
    try:
        model = nn.Linear(2, 1)  # float64 parameters
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)
        checker = NonFiniteChecker()

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.ones(1, 2)).sum() * float("inf")
            checker.scale(loss).backward()
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        checker.step(opt, closure)
        assert checker.step_was_skipped(opt) is True
        assert checker.found_inf().dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_unpickled_scaler_keeps_the_fast_path_and_claims_nothing():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=5, hysteresis=2)
    assert scaler.scale_kept is False  # nothing recorded yet: a new scaler claims nothing
    for bad in (True, False, False):
        _plain_cycle(scaler, model, opt, bad)
        scaler.update()
        opt.zero_grad()
    assert scaler.scale_kept is True
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.scale_kept is False
    assert copy.state_dict() == scaler.state_dict()  # trackers included
    _plain_cycle(copy, model, opt)
    with HostSyncCounter() as counter:
        copy.update()
    assert counter.count == 0  # the host still knows the tracker: no read back
    assert copy.state_dict()["_growth_tracker"] == 3


class _Flaky(torch.optim.SGD):
    """Plain SGD whose step raises while ``fail`` is set (after the scaler unscaled its gradients)."""

    fail = True

    def step(self, closure=None):
        if self.fail:
            raise RuntimeError("step failed")
        return super().step(closure)


@pytest.mark.parametrize("unscale", ["no", "first", "before_retry"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-unchecked"])
def test_a_step_that_raises_propagates_and_a_retry_applies_the_true_gradients_once(precision, unscale):
    """The retry without a backward applies the gradients unscaled once (not divided twice, and an unscale before
    it is no error); after a new backward it applies the new gradients, unscaled anew. What the optimizer consumed:
    the delta against -lr * grad."""
    model = nn.Linear(2, 1)
    opt = _Flaky(model.parameters(), lr=0.5)
    if precision == "16-mixed":
        engine = AmpEngine(precision, DynamicLossScaler("cpu", init_scale=8.0))
    else:
        engine = AmpEngine("bf16-mixed", None, skip_nonfinite=precision == "bf16-mixed")
    for new_backward in (False, True):
        opt.fail = True
        opt.zero_grad()
        engine.scale(model(torch.ones(1, 2)).sum()).backward()  # true gradient of the weight: [1, 1]
        engine.begin(opt, int(new_backward))
        if unscale == "first":
            engine.unscale(opt)
        with pytest.raises(RuntimeError, match="^step failed$"):
            engine.step(opt)
        opt.fail = False
        true_grad = torch.ones(1, 2)
        if new_backward:
            opt.zero_grad()
            engine.scale(model(torch.full((1, 2), 3.0)).sum()).backward()
            true_grad = torch.full((1, 2), 3.0)
        if unscale != "no" and (new_backward or unscale == "before_retry"):
            engine.unscale(opt)  # clipping before the retried step: it clips the true gradients
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5 * true_grad.max().item())
            true_grad = true_grad * 0.5
        before = model.weight.detach().clone()
        engine.step(opt)
        engine.end_cycle()
        assert torch.equal(model.weight.detach(), before - 0.5 * true_grad)
    assert engine.history.num_steps == 2
    assert engine.history.skipped_steps == []


def test_a_bf16_update_records_with_no_device_op_of_its_own():
    """bf16's checker keeps its scale of 1: after the first record, a clean update costs no device op."""
    model, accumulating = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("bf16-mixed", None)
    engine.register([opt, torch.optim.SGD(accumulating.parameters(), lr=0.0)])  # never steps: its gradients pend
    accumulating(torch.ones(1, 2)).sum().backward()
    counts = []
    for step in range(4):
        _engine_cycle(engine, model, opt, step, bad=step == 2)
        with OpCounter() as counter:
            engine.end_cycle()
        counts.append(dict(counter.ops))
        opt.zero_grad()
    assert counts[1] == counts[3] == {}  # clean updates after the first; no scale moves pending gradients
    assert engine.history.skipped_steps == [2]


def test_asking_a_fused_optimizers_outcome_without_a_sync_costs_none():
    """`step_was_skipped(opt, sync=False)`: None while the flag is on the device, and no sync; with the sync: the
    answer, at one host read."""
    plugin = AmpPlusPrecision("16-mixed", device="cpu", init_scale=8.0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    engine = plugin.engine
    for bad in (False, True):
        engine.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
        engine.begin(opt)
        engine.step(opt)
        with HostSyncCounter() as quiet:
            assert plugin.step_was_skipped(opt, sync=False) is None
        with HostSyncCounter() as read:
            assert plugin.step_was_skipped(opt) is bad
        assert (quiet.count, read.count) == (0, 1)
        engine.end_cycle()
        opt.zero_grad()


class _ExtraScheduler(TinyModel):
    """Steps a scheduler of its own (not returned by configure_optimizers) through `lr_scheduler_step`."""

    def on_train_start(self):
        self.extra = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0), 1, 0.5)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lr_scheduler_step(self.extra, None)


def test_a_scheduler_lightning_does_not_know_steps_through_the_hook():
    model = _ExtraScheduler(poison={1: "inf"})
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0)], max_steps=3).fit(model)
    assert model.extra.last_epoch == 3  # the skip rule is for the schedulers Lightning steps, per optimizer


def test_with_sync_skips_a_fused_update_is_known_on_the_host_after_it():
    plugin = AmpPlusPrecision("16-mixed", device="cpu", init_scale=8.0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    engine = plugin.engine
    engine.listen(listener(needs_host_skips=True))  # what NaNSkipReporter(sync_fused=True) asks for
    for bad in (False, True, False):
        engine.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
        engine.begin(opt)
        engine.step(opt)
        engine.end_cycle()
        assert engine.skip_known_on_host
        with HostSyncCounter() as counter:
            assert plugin.optimizer_step_was_skipped is bad
        assert counter.count == 0
        opt.zero_grad()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("bad", [False, True])
def test_a_failed_step_never_retried_leaves_the_next_update_exact(precision, bad):
    """Fail, close the update without a retry, then a new backward and step: the new gradients are unscaled and
    checked as usual (an inf loss is skipped, the weights stay finite)."""
    model = nn.Linear(2, 1)
    opt = _Flaky(model.parameters(), lr=0.5)
    scaler = DynamicLossScaler("cpu", init_scale=8.0) if precision == "16-mixed" else None
    engine = AmpEngine(precision, scaler)
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    with pytest.raises(RuntimeError, match="^step failed$"):
        engine.step(opt)
    engine.end_cycle()
    opt.fail = False
    opt.zero_grad()
    loss = model(torch.full((1, 2), 3.0)).sum() * (float("inf") if bad else 1.0)
    engine.scale(loss).backward()
    engine.begin(opt, 1)
    before = model.weight.detach().clone()
    engine.step(opt)
    engine.end_cycle()
    if bad:
        assert torch.equal(model.weight.detach(), before)
        assert engine.history.skipped_steps == [1]
    else:
        assert torch.equal(model.weight.detach(), before - 0.5 * torch.full((1, 2), 3.0))
        assert engine.history.skipped_steps == []


def test_a_fused_step_that_raises_leaves_no_scale_on_the_optimizer():
    """torch's GradScaler hands a fused optimizer `grad_scale`/`found_inf` and removes them only after a successful
    step; a failed one must not leave them for the next plain step to divide by."""
    model = nn.Linear(2, 1)
    opt = _Flaky(model.parameters(), lr=0.5, fused=True)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    with pytest.raises(RuntimeError, match="^step failed$"):
        engine.step(opt)
    assert not hasattr(opt, "grad_scale")
    assert not hasattr(opt, "found_inf")
    opt.fail = False
    before = model.weight.detach().clone()
    engine.step(opt)
    engine.end_cycle()
    assert torch.equal(model.weight.detach(), before - 0.5 * torch.ones(1, 2))


def test_an_unscale_forgotten_while_another_optimizer_stepped_is_done_again_for_the_new_gradients():
    """Two optimizers in one update: the first steps, the second is unscaled, then a backward comes before its step.
    Its unscale is forgotten while the update stays open; clipping before its step then clips the
    new gradients unscaled, and the step applies them once."""
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.5)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(first(torch.ones(1, 2)).sum() + second(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt_a)
    engine.step(opt_a)
    engine.unscale(opt_b)
    opt_b.zero_grad()
    engine.scale(second(torch.full((1, 2), 3.0)).sum()).backward()  # zeroed first: true weight gradient [3, 3]
    assert engine.cycle is not None  # the update is still open
    assert opt_a in engine.cycle.stepped
    engine.unscale(opt_b)
    torch.nn.utils.clip_grad_value_(second.parameters(), 1.5)  # half the true gradient
    before = second.weight.detach().clone()
    engine.step(opt_b)
    engine.end_cycle()
    assert torch.equal(second.weight.detach(), before - 0.5 * torch.full((1, 2), 1.5))


@pytest.mark.parametrize("unscale", [False, True])
def test_gradients_already_applied_keep_their_values_when_the_scale_grows(unscale):
    """After the update the gradients are the true ones whatever the new scale (hooks after the step read them)."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0, growth_interval=1))
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    if unscale:
        engine.unscale(opt)
    engine.step(opt)
    engine.end_cycle()
    assert engine.scaler.get_scale() == 16.0  # it grew
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
    assert torch.equal(model.bias.grad, torch.ones(1))


def test_step_was_skipped_before_and_after_a_step_in_every_precision():
    model = nn.Linear(2, 1)
    for engine in (
        AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0)),
        AmpEngine("bf16-mixed", None),
        AmpEngine("bf16-mixed", None, skip_nonfinite=False),
    ):
        fused = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)
        assert engine.step_was_skipped(fused) is None  # it has not stepped
        engine.scale(model(torch.ones(1, 2)).sum()).backward()
        engine.begin(fused, 0)
        engine.step(fused)
        assert engine.step_was_skipped(fused) is False  # the default reads a fused optimizer's flag
        engine.end_cycle()
        fused.zero_grad()


def test_a_stock_bf16_checkpoint_state_loads_into_either_precision():
    """Lightning's MixedPrecision('bf16-mixed') saves an empty state: nothing to load, nothing refused."""
    for precision, scaler in (("16-mixed", DynamicLossScaler("cpu", init_scale=8.0)), ("bf16-mixed", None)):
        engine = AmpEngine(precision, scaler)
        engine.load_state_dict({})
        assert engine.state_dict()["precision"] == precision
        if scaler is not None:
            assert scaler.get_scale() == 8.0


def test_a_history_resumed_under_the_other_precision_shows_this_runs_scale():
    """bf16 -> 16-mixed: the scale starts at init_scale and the history records it at the next update, even when
    that update keeps the scale; 16-mixed -> bf16: the history shows no scale."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    bf16 = AmpEngine("bf16-mixed", None)
    for step in range(2):
        _engine_cycle(bf16, model, opt, step)
        bf16.end_cycle()
    fp16 = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0, growth_interval=100))
    for step in range(2):  # it trained before (a first fit): its last update kept the scale
        _engine_cycle(fp16, model, opt, step)
        fp16.end_cycle()
    fp16.load_state_dict(bf16.state_dict())
    assert fp16.history.scaled is True
    _engine_cycle(fp16, model, opt, 2)
    fp16.end_cycle()
    assert fp16.history.curve()[-1] == (2, 8.0)
    back = AmpEngine("bf16-mixed", None)
    back.load_state_dict(fp16.state_dict())
    assert back.history.scaled is False


def test_gradients_unscaled_but_not_stepped_keep_their_values_when_the_scale_grows():
    """One optimizer steps (the scale grows), another was unscaled (e.g. clipped to log its norm) and did not step:
    its gradients are true values, not scaled ones, and are left as they are."""
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.0)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0, growth_interval=1))
    engine.register([opt_a, opt_b])  # as the plugins do when the model connects
    engine.scale(first(torch.ones(1, 2)).sum() + second(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt_a, 0)
    engine.unscale(opt_b)
    engine.step(opt_a)
    engine.end_cycle()
    assert engine.scaler.get_scale() == 16.0
    assert torch.equal(second.weight.grad, torch.ones(1, 2))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-unchecked"])
def test_a_new_run_knows_no_skip_of_the_last_one(precision):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if precision == "16-mixed":
        engine = AmpEngine(precision, DynamicLossScaler("cpu", init_scale=8.0))
    else:
        engine = AmpEngine("bf16-mixed", None, skip_nonfinite=False)
    _engine_cycle(engine, model, opt, 0, bad=precision == "16-mixed")
    engine.end_cycle()
    assert engine.optimizer_step_was_skipped is (precision == "16-mixed")
    engine.reset()
    assert engine.optimizer_step_was_skipped is False
    assert engine.step_was_skipped(opt) is None


def test_unscaling_an_optimizer_that_stepped_in_the_open_update_is_torchs_error_and_changes_nothing():
    """Its gradients were unscaled by its step: a second unscale would divide them again."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    engine.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        engine.unscale(opt)
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
    assert engine.cycle is not None  # the update stays open: it closes once, as usual
    engine.end_cycle()
    assert engine.history.num_steps == 1


def test_a_failed_step_retried_after_a_new_backward_while_another_optimizer_stepped_unscales_the_new_gradients():
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.5)
    opt_b = _Flaky(second.parameters(), lr=0.5)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(first(torch.ones(1, 2)).sum() + second(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt_a, 0)
    engine.step(opt_a)
    engine.unscale(opt_b)
    with pytest.raises(RuntimeError, match="^step failed$"):
        engine.step(opt_b)
    opt_b.fail = False
    opt_b.zero_grad()
    engine.scale(second(torch.full((1, 2), 3.0)).sum()).backward()  # new gradients: true weight gradient [3, 3]
    engine.unscale(opt_b)
    assert torch.equal(second.weight.grad, torch.full((1, 2), 3.0))  # what clipping here would see
    before = second.weight.detach().clone()
    engine.step(opt_b)
    engine.end_cycle()
    assert torch.equal(second.weight.detach(), before - 0.5 * torch.full((1, 2), 3.0))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_listeners_before_unscale_run_where_there_is_a_scale(precision):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler("cpu", init_scale=8.0) if precision == "16-mixed" else None
    engine = AmpEngine(precision, scaler)
    heard = []
    engine.listen(
        listener(before_unscale=lambda optimizer, step: heard.append((optimizer, step, model.weight.grad.clone())))
    )
    _engine_cycle(engine, model, opt, 3)
    if precision == "16-mixed":
        ((optimizer, step, grad),) = heard
        assert (optimizer, step) == (opt, 3)
        assert torch.equal(grad, torch.full((1, 2), 8.0))  # still scaled when it was heard
    else:
        assert heard == []


@pytest.mark.parametrize("another_stepped", [False, True])
def test_an_unscale_without_a_step_in_an_update_that_closed_is_forgotten_and_said(another_stepped):
    """Clipped, then no step, and the batch ends (the update closes; another optimizer may have stepped in it). The
    next backward adds scaled gradients to the unscaled ones: the step must unscale all of them (the earlier part is
    then divided twice, and the backward says so), never apply the new part still multiplied by the scale."""
    model, other = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0, growth_interval=100))
    engine.register([opt, opt_other])
    engine.scale(model(torch.ones(1, 2)).sum() + other(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    engine.unscale(opt)  # e.g. clipping; true weight gradient [1, 1]
    if another_stepped:
        engine.step(opt_other)
    engine.end_cycle()
    with pytest.warns(AmpPlusWarning, match=r"^1 optimizer\(s\) had their gradients unscaled .* did not step"):
        engine.scale(model(torch.ones(1, 2)).sum()).backward()  # accumulates: 1 (unscaled) + 8 (scaled)
    before = model.weight.detach().clone()
    engine.begin(opt, 1)
    engine.step(opt)
    engine.end_cycle()
    assert torch.equal(model.weight.detach(), before - 0.5 * torch.full((1, 2), 9.0 / 8.0))


def test_an_unscale_without_a_step_is_quiet_when_the_gradients_were_zeroed():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    engine.unscale(opt)
    engine.end_cycle()
    opt.zero_grad()
    engine.scale(model(torch.ones(1, 2)).sum()).backward()  # no warning: AmpPlusWarning is an error in the suite
    before = model.weight.detach().clone()
    engine.begin(opt, 1)
    engine.step(opt)
    engine.end_cycle()
    assert torch.equal(model.weight.detach(), before - 0.5 * torch.ones(1, 2))


def test_a_bare_engine_warns_after_50_skipped_updates_and_reduces_over_no_rank(monkeypatch):
    """AmpEngine's own defaults (the plugins pass theirs): warn_skip_streak=50, not sharded."""
    from tests.helpers.sharded import FakePeer

    peer = FakePeer(monkeypatch, lambda tensor, op: torch.ones_like(tensor))
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("bf16-mixed", None)
    assert engine.skip_nonfinite is True
    for step in range(49):
        _engine_cycle(engine, model, opt, step, bad=True)
        engine.end_cycle()
        opt.zero_grad()
    assert peer.calls == []  # whole gradients on each rank: nothing to reduce
    _engine_cycle(engine, model, opt, 49, bad=True)
    with pytest.warns(AmpPlusWarning, match=r"^50 optimizer updates in a row were skipped"):
        engine.end_cycle()


def test_an_unchecked_bf16_engine_takes_an_unscale_without_a_step():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = AmpEngine("bf16-mixed", None, skip_nonfinite=False)  # nothing checks: nothing to forget
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    engine.unscale(opt)
    engine.end_cycle()
    opt.zero_grad()
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    before = model.weight.detach().clone()
    engine.begin(opt, 1)
    engine.step(opt)
    engine.end_cycle()
    assert torch.equal(model.weight.detach(), before - 0.5 * torch.ones(1, 2))


def test_the_same_optimizer_stepping_twice_makes_two_updates_and_a_bare_second_step_is_refused():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    for step in range(2):  # a second backward and step before the update closed: the first one closes it
        engine.scale(model(torch.ones(1, 2)).sum()).backward()
        engine.begin(opt, step)
        engine.step(opt)
    engine.end_cycle()
    assert engine.history.num_steps == 2
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 2)
    engine.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        engine.step(opt)  # no backward, no new update: the gradients would be applied twice


def test_an_unscale_carried_into_the_next_update_is_said_once_at_the_next_backward():
    model = nn.Linear(2, 1)
    opt = _Flaky(model.parameters(), lr=0.5)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 0)
    engine.unscale(opt)
    with pytest.raises(RuntimeError, match="^step failed$"):
        engine.step(opt)
    engine.abort_cycle()
    engine.begin(opt, 1)  # the retry's update: the unscale is carried into it
    with pytest.warns(AmpPlusWarning, match=r"^1 optimizer\(s\) had their gradients unscaled"):
        engine.scale(model(torch.ones(1, 2)).sum()).backward()  # but a backward came first: forgotten, once


@pytest.mark.parametrize(("limit", "expected"), [(2, [1, 4]), (1, [0, 3])])
def test_each_streak_of_skips_is_warned_about(limit, expected):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=2.0**20), warn_skip_streak=limit)
    warned = []
    for step, bad in enumerate([True, True, False, True, True]):
        _engine_cycle(engine, model, opt, step, bad=bad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.end_cycle()
        warned += [step for w in caught if w.category is AmpPlusWarning]
        opt.zero_grad()
    assert warned == expected


def test_an_update_that_closes_without_a_step_keeps_the_last_outcome():
    """Unscaled (to clip, say) and closed with no step: nothing was decided, so the last update's outcome stands."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = AmpEngine("16-mixed", DynamicLossScaler("cpu", init_scale=8.0))
    _engine_cycle(engine, model, opt, 0, bad=True)
    engine.end_cycle()
    assert engine.closed.skipped is True
    opt.zero_grad()
    engine.scale(model(torch.ones(1, 2)).sum()).backward()
    engine.begin(opt, 1)
    engine.unscale(opt)
    engine.end_cycle()  # no step
    assert engine.closed.skipped is True
    assert engine.optimizer_step_was_skipped
    assert engine.history.num_steps == 1  # and nothing was recorded for it
