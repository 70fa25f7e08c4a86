"""Faults: exceptions mid-step never leave a stale unscale, a failed step is not counted, teardown lets the real error
through, and the plugin cleans up everything it installed."""

import sys
import warnings

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_amp_plus import (
    AmpPlusFabricPrecision,
    AmpPlusPrecision,
    AmpPlusWarning,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer
from tests.test_exactness import AutoRecorder, assert_sgd_update


class RaisesOnce(TinyModel):
    """Raises from ``on_before_optimizer_step`` (after the unscale) at one global step."""

    def __init__(self, at: int, where: str = "hook", **kwargs):
        super().__init__(**kwargs)
        self.at, self.where = at, where

    def on_before_optimizer_step(self, optimizer):
        if self.where == "hook" and self.trainer.global_step == self.at:
            raise RuntimeError("boom in the hook")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.where == "clip" and self.trainer.global_step == self.at:
            raise RuntimeError("boom in clipping")


@pytest.mark.parametrize("where", ["hook", "clip"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
def test_an_exception_after_the_unscale_leaves_no_stale_unscale_for_the_next_fit(where, optimizer):
    model = RaisesOnce(at=1, where=where, optimizer=optimizer, lr=0.1)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**14)
    with pytest.raises(RuntimeError, match=f"boom in {'the hook' if where == 'hook' else 'clipping'}"):
        make_trainer(plugins=[plugin], max_steps=4, gradient_clip_val=0.05).fit(model)  # no second, misleading error
    assert plugin.history.num_steps == 1  # step 0 ran; step 1 never stepped and is not counted
    assert plugin.applied_steps == 1
    assert not plugin.engine.cycle_open
    # the same plugin trains on (a notebook retry): every step unscales what it applies
    model.at = -1
    recorder = AutoRecorder()
    make_trainer(plugins=[plugin], callbacks=[recorder], max_steps=3, gradient_clip_val=0.05).fit(model)
    assert len(recorder.records) == 3
    for before, after, grads, _ in recorder.records:
        assert max(float(g.abs().max()) for g in grads.values()) < 10  # true gradients, not 2**14 times them
        assert_sgd_update(before, after, grads, 0.05)


class FailingSGD(torch.optim.SGD):
    def __init__(self, *args, fail_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.fail_at = 0, fail_at

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("optimizer step failed")
        return super().step(closure)


def test_a_failed_optimizer_step_is_not_counted_and_teardown_does_not_mask_it(tmp_path):
    class Model(TinyModel):
        def configure_optimizers(self):
            return FailingSGD(self.parameters(), lr=0.1, fail_at=4)

    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    reporter = NaNSkipReporter()
    with pytest.raises(RuntimeError, match="optimizer step failed"):
        make_trainer(
            plugins=[plugin], callbacks=[reporter, LossScaleMonitor()], max_steps=6, logger=CSVLogger(tmp_path)
        ).fit(Model())
    assert plugin.applied_steps == 3  # only 3 steps ran
    assert plugin.history.num_steps == 3


def test_fabric_loop_that_catches_an_exception_after_clipping_continues_exactly():
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**12)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fmodel, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (x, y) in enumerate(make_loader()):
        if step == 4:
            break
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(fmodel(x), y))
        scale = plugin.loss_scale
        grads = {n: p.grad.double() / scale for n, p in model.named_parameters()}
        fabric.clip_gradients(fmodel, opt, max_norm=0.05)
        if step == 1:
            continue  # the user's loop drops this step after clipping (say, an exception it caught)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        assert_sgd_update(before, {n: p.detach() for n, p in model.named_parameters()}, grads, 0.05)
    assert plugin.history.num_steps == 3


def test_a_new_backward_onto_unscaled_unstepped_gradients_warns_and_never_applies_them_scaled():
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**12)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Linear(8, 1)
    fmodel, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(make_loader()))
    fabric.backward(nn.functional.mse_loss(fmodel(x), y))
    fabric.clip_gradients(fmodel, opt, max_norm=1e6)  # unscaled, then no step
    with pytest.warns(AmpPlusWarning, match=r"1 optimizer\(s\) had their gradients unscaled .* did not step"):
        fabric.backward(nn.functional.mse_loss(fmodel(x), y))
    before = model.weight.detach().clone()
    opt.step()
    assert float((model.weight - before).abs().max()) < 1.0  # unscaled: a true-sized update, not 4096x


def test_teardown_restores_the_users_own_scheduler_hook_and_removes_everything_installed():
    model = TinyModel(scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    calls = []

    def users_hook(scheduler, metric):
        calls.append(1)
        scheduler.step()

    model.lr_scheduler_step = users_hook  # an instance-level override of the user's own
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0, fp32_modules=["net.2"])
    callbacks = [
        LossScaleMonitor(),
        NaNSkipReporter(),
        GradUnderflowMonitor(every_n_steps=1),
        PrecisionReport(print_table=False),
    ]
    with pytest.warns(AmpPlusWarning, match="has no logger"):
        make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=3).fit(model)
    assert calls == [1, 1, 1]  # the wrapper called it while fitting
    assert model.__dict__["lr_scheduler_step"] is users_hook  # restored, not deleted
    assert plugin.listeners == ()
    assert plugin.fp32_module_names == []
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_optimizer_step_was_skipped_with_a_fused_optimizer():
    flags = []

    class Probe(AutoRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flags.append(
                (trainer.precision_plugin.skip_known_on_host, trainer.precision_plugin.optimizer_step_was_skipped)
            )

    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    make_trainer(plugins=[plugin], callbacks=[Probe()], max_steps=4).fit(
        TinyModel(optimizer="fused_adamw", lr=1e-3, poison={2: "nan"})
    )
    # the first step made optimizer state: read once (a skipped first step must not leave fused state behind); then
    # decided on the device, read only when asked
    assert flags == [(True, False), (False, False), (False, True), (False, False)]


def test_islands_match_subclasses_of_a_named_class():
    class MyLinear(nn.Linear):
        pass

    class Model(TinyModel):
        def __init__(self):
            super().__init__()
            self.net[2] = MyLinear(16, 1)
            self.dtypes = {}

        def training_step(self, batch, batch_idx):
            self.dtypes = {"net.0": self.net[0](batch[0]).dtype, "net.2": self.net[2](torch.randn(2, 16)).dtype}
            return super().training_step(batch, batch_idx)

    model = Model()
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=[MyLinear])
    make_trainer(plugins=[plugin], max_steps=1).fit(model)
    assert model.dtypes == {"net.0": torch.float16, "net.2": torch.float32}
    both = Model()
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=[nn.Linear])  # the base class matches the subclass too
    make_trainer(plugins=[plugin], max_steps=1).fit(both)
    assert both.dtypes == {"net.0": torch.float32, "net.2": torch.float32}


def test_report_flags_in_bf16():
    from tests.callbacks.test_precision_report import Mixed

    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[AmpPlusPrecision("bf16-mixed", fp32_modules=["net.2"])], callbacks=[report], max_steps=1).fit(
        Mixed()
    )
    rows = {r["name"]: r for r in report.rows}
    assert rows["net.0"]["output_dtype"] == "bfloat16"
    assert not rows["net.0"]["flagged"]
    assert not rows["net.2"]["flagged"]  # an island is the user's choice
    assert rows["net.2"]["island"] == "net.2"
    assert rows["head"]["flagged"]
    assert "autocast disabled" in rows["head"]["cause"]


class ClipBothStepOne(LightningModule):
    """Two optimizers behind one backward; both clipped, only `a` steps on even batches (b's unscale is forgotten)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
        self.records = []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y))
        scale = self.trainer.precision_plugin.loss_scale
        grads_b = {n: p.grad.double() / scale for n, p in self.b.named_parameters()}
        before_b = {n: p.detach().clone() for n, p in self.b.named_parameters()}
        self.clip_gradients(opt_a, gradient_clip_val=10.0, gradient_clip_algorithm="norm")
        self.clip_gradients(opt_b, gradient_clip_val=10.0, gradient_clip_algorithm="norm")
        opt_a.step()
        if batch_idx % 2 == 1:
            opt_b.step()
            self.records.append((before_b, {n: p.detach().clone() for n, p in self.b.named_parameters()}, grads_b))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

    def train_dataloader(self):
        return make_loader()


def test_an_optimizer_clipped_but_not_stepped_is_warned_about_and_its_next_step_is_exact():
    model = ClipBothStepOne()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12)
    with pytest.warns(AmpPlusWarning, match=r"^1 optimizer\(s\) had their gradients unscaled") as w:
        make_trainer(plugins=[plugin], max_steps=6).fit(model)  # batches: 1, 2, 1 optimizer steps
    assert len([x for x in w if "did not step" in str(x.message)]) == 2  # batches 0 and 2, b only
    assert len(model.records) == 2  # batches 1 and 3
    for before, after, grads in model.records:
        assert_sgd_update(before, after, grads, 10.0)  # b's steps after a forgotten unscale: exact, not 4096x


def test_bf16_two_optimizers_both_overflowing_is_one_skipped_update():
    from tests.test_exactness import TwoOptimizersClipped

    class BothOverflow(TwoOptimizersClipped):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                handle = self.b.weight.register_hook(lambda g: g * float("nan"))
                super().training_step(batch, batch_idx)
                handle.remove()
                return
            super().training_step(batch, batch_idx)

    model = BothOverflow(poison_step=2)
    plugin = AmpPlusPrecision("bf16-mixed")
    make_trainer(plugins=[plugin], max_steps=6).fit(model)
    assert plugin.history.skipped_steps == [1]  # both flags summed, not cancelled (batch 1: logger step 1)
    _, record, _ = model.records
    for key in ("a", "b"):
        before, after, _ = record[key]
        assert all(torch.equal(before[n], after[n]) for n in before)


def test_bf16_fused_optimizer_skip_is_known_per_optimizer():
    flags = []

    class Probe(AutoRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flags.append(trainer.precision_plugin.step_was_skipped(trainer.optimizers[0]))

    plugin = AmpPlusPrecision("bf16-mixed")
    trainer = make_trainer(plugins=[plugin], callbacks=[Probe()], max_steps=3)
    trainer.fit(TinyModel(optimizer="fused_adamw", lr=1e-3, poison={1: "nan"}))
    assert flags == [False, True, False]
    optimizer = trainer.optimizers[0]
    assert plugin.step_was_skipped(optimizer) is plugin.step_was_skipped(optimizer) is False  # read once, kept
    assert plugin.history.curve() == [(0, 1.0)]


def test_bf16_without_the_check_records_scale_one_and_no_skips():
    plugin = AmpPlusPrecision("bf16-mixed", skip_nonfinite=False)
    make_trainer(plugins=[plugin], max_steps=3).fit(TinyModel())
    assert plugin.history.curve() == [(0, 1.0)]
    assert plugin.history.num_steps == 3
    assert plugin.history.last_step == 2


def test_the_streak_warning_counts_skips_in_a_row_and_comes_at_the_threshold():
    steps_when_warned = []

    class When(AutoRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            streaks = [w for w in self.caught if "in a row were skipped" in str(w.message)]
            if len(streaks) > len(steps_when_warned):
                steps_when_warned.append(trainer.global_step - 1)

    probe = When()
    plugin = AmpPlusPrecision("16-mixed", min_scale=2.0**-20, warn_skip_streak=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe.caught = caught
        # streaks of 2, 3 and 1 skipped updates between clean ones
        make_trainer(plugins=[plugin], callbacks=[probe], max_steps=12).fit(
            TinyModel(poison={s: "inf" for s in (2, 3, 5, 6, 7, 9)})
        )
    streak = [w for w in caught if "in a row were skipped" in str(w.message)]
    assert [str(w.message).split(",")[0] for w in streak] == [
        "3 optimizer updates in a row were skipped (inf/nan gradients)"
    ]
    assert steps_when_warned == [7]
    plugin = AmpPlusPrecision("16-mixed", warn_skip_streak=1)
    make_trainer(plugins=[plugin], max_steps=4).fit(TinyModel())  # clean: no warning (AmpPlusWarning is an error)


def test_a_failed_step_after_a_skipped_one_records_the_skip():
    class SecondFails(ClipBothStepOne):
        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            x, y = batch
            handle = self.a.weight.register_hook(lambda g: g * float("inf"))
            self.manual_backward(nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y))
            handle.remove()
            opt_a.step()  # skipped: a overflowed
            opt_b.optimizer.step = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("b failed"))
            opt_b.step()

    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    reporter = NaNSkipReporter(max_warnings=0)
    with pytest.raises(RuntimeError, match="b failed"):
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=4).fit(SecondFails())
    assert plugin.history.num_steps == 1  # a's skipped step is recorded; b's failed one is not counted
    assert plugin.history.skipped_steps == [0]
    assert reporter.skipped_steps == [0]
    assert [o["name"] for o in reporter.skips[0]["offenders"]] == ["a.weight"]


def test_the_scheduler_hook_passes_the_monitored_metric_and_is_gone_after_fit():
    metrics = []

    class Watched(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("watched", float(batch_idx + 10))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "watched"}}

        def lr_scheduler_step(self, scheduler, metric):
            metrics.append(float(metric))

    model = Watched(poison={1: "inf"})
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0)], max_steps=3).fit(model)
    assert metrics == [10.0, 12.0]  # the skipped step 1 holds the scheduler back; the metric reaches the others
    assert "lr_scheduler_step" not in vars(model)  # the plugin's wrapper is removed; the class's hook is back


def test_the_engines_warnings_point_at_the_users_line():
    """Not at Lightning's or the package's frames: at the `fabric.backward(...)` or `trainer.fit(...)` behind them."""
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**12)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Linear(8, 1)
    fmodel, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(4, 8)
    fabric.backward(fmodel(x).sum())
    fabric.clip_gradients(fmodel, opt, max_norm=1e6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.backward(fmodel(x).sum())
        line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in caught if w.category is AmpPlusWarning] == [(__file__, line)]
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0, warn_skip_streak=2)], max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(poison={0: "inf", 1: "inf"}))
        line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in caught if w.category is AmpPlusWarning] == [(__file__, line)]


def test_the_streak_warning_of_a_manual_training_step_points_at_the_users_fit():
    """The update closes inside the plugin's training-step context manager (contextlib's frames): still the user's."""

    class Manual(TinyModel):
        def __init__(self):
            super().__init__(poison={0: "inf", 1: "inf"})
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0, warn_skip_streak=2)], max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Manual())
        line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in caught if w.category is AmpPlusWarning] == [(__file__, line)]


class _FailsOnce(torch.optim.SGD):
    """SGD whose first step raises (after the plugin unscaled its gradients)."""

    failed = False

    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("step failed")
        return super().step(closure)


@pytest.mark.parametrize("update", ["step", "manual"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_step_retried_through_fabric_after_it_raised_applies_the_true_gradient_once(precision, update):
    """The plugin closes the update when a step raises; the unscale stays until the next backward, so the retry
    (no backward in between) applies the gradients once, not divided by the scale again."""
    kwargs = {"init_scale": 8.0} if precision == "16-mixed" else {}
    plugin = AmpPlusFabricPrecision(precision, update=update, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Linear(2, 1)
    fmodel, opt = fabric.setup(model, _FailsOnce(model.parameters(), lr=0.5))
    fabric.backward(fmodel(torch.ones(1, 2)).sum())  # true weight gradient [1, 1]
    with pytest.raises(RuntimeError, match="^step failed$"):
        opt.step()
    before = model.weight.detach().clone()
    opt.step()
    if update == "manual":
        plugin.update()
    assert torch.equal(model.weight.detach(), before - 0.5 * torch.ones(1, 2))
    assert plugin.history.num_steps == 1


@pytest.mark.parametrize("fused", ["sgd", "adam"])
def test_a_fused_step_retried_after_it_raised_in_a_plain_loop_applies_the_true_gradient_once(fused):
    """Break pass: the fused protocol's ``grad_scale`` was left on the optimizer by a step that raised (torch's
    GradScaler leaves it too); the retry took it for a scale of yours and divided the gradients by the scale twice."""
    from lightning_amp_plus import DynamicLossScaler

    def run(raise_once):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        base = torch.optim.SGD if fused == "sgd" else torch.optim.Adam

        class Flaky(base):
            calls = 0

            def step(self, *args, **kwargs):
                Flaky.calls += 1
                if raise_once and Flaky.calls == 1:
                    raise ValueError("boom")
                return super().step(*args, **kwargs)

        opt = Flaky(model.parameters(), lr=0.1, fused=True)
        scaler = DynamicLossScaler("cpu", init_scale=1024.0)
        scaler.scale(model(torch.ones(2, 4)).mean()).backward()
        try:
            scaler.step(opt)
        except ValueError:
            assert not hasattr(opt, "grad_scale")
            assert not hasattr(opt, "found_inf")
            scaler.step(opt)  # the retry, no new backward
        scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))
