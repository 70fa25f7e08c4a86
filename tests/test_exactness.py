"""What the optimizer consumed: parameter deltas against ``-lr * clipped true gradient`` with plain SGD.

Every optimization path (automatic, manual, accumulation, two optimizers, fused and non-fused, with and without
Lightning's ``LightningOptimizer`` wrapper, fp16 and bf16) is checked by the update the weights received, not by a
norm read in a hook. A gradient unscaled twice, or not at all, moves the weights by 1/scale or scale times too much.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, AmpPlusWarning
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer

LR = 0.1


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Norm clipping written out (Lightning/torch: coefficient ``max_norm / (norm + 1e-6)``, at most 1)."""
    if max_norm <= 0:
        return grads
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    return {n: g * coef for n, g in grads.items()}


def assert_sgd_update(before, after, true_grads, max_norm: float) -> None:
    expected = clipped(true_grads, max_norm)
    for name, grad in expected.items():
        delta = (after[name].double() - before[name].double()).float()
        torch.testing.assert_close(delta, (-LR * grad).float(), rtol=2e-3, atol=2e-7, msg=name)


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def true_grads(module: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double() / scale for n, p in module.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------- manual optimization
class ManualSGD(LightningModule):
    """The README's manual pattern: ``clip_gradients(self.optimizers(), ...)`` then ``opt.step()``."""

    def __init__(self, wrapper: bool = True, fused: bool = False, clip: float = 0.05, poison: tuple = ()):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.wrapper, self.fused, self.clip, self.poison = wrapper, fused, clip, poison
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        target = opt if self.wrapper else opt.optimizer  # clip through the wrapper or the optimizer inside
        opt.zero_grad()
        loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
        step = self.trainer.global_step
        if step in self.poison:
            loss = loss * float("inf")
        self.manual_backward(loss)
        plugin = self.trainer.precision_plugin
        scale = plugin.loss_scale
        grads = true_grads(self, scale)
        before = params(self)
        self.clip_gradients(target, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()  # a raw `optimizer.step()` would bypass Lightning (and the plugin) altogether
        self.records.append(
            {
                "step": step,
                "before": before,
                "after": params(self),
                "grads": grads,
                "skipped": plugin.step_was_skipped(opt),
            }
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, fused=self.fused or None)

    def train_dataloader(self):
        return make_loader()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("wrapper", [True, False])
def test_manual_clip_then_step_applies_exactly_the_clipped_true_gradient(wrapper, fused):
    model = ManualSGD(wrapper=wrapper, fused=fused, poison=(2,))
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12)
    make_trainer(plugins=[plugin], max_steps=5).fit(model)  # AmpPlusWarning would fail the test
    assert [r["skipped"] for r in model.records] == [False, False, True, False, False]
    for record in model.records:
        if record["skipped"]:
            assert all(torch.equal(record["before"][n], record["after"][n]) for n in record["before"])
        else:
            assert_sgd_update(record["before"], record["after"], record["grads"], 0.05)
    assert plugin.history.skipped_steps == [2]
    assert plugin.applied_steps == 4


def test_step_was_skipped_means_the_same_optimizer_through_any_wrapper():
    model = ManualSGD(poison=(1,))
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    trainer = make_trainer(plugins=[plugin], max_steps=2)
    trainer.fit(model)
    wrapper = model.optimizers()
    raw = trainer.optimizers[0]
    assert wrapper is not raw
    assert plugin.step_was_skipped(wrapper) is plugin.step_was_skipped(raw) is True
    assert plugin.engine.step_was_skipped(wrapper) is True
    assert plugin.scaler.step_was_skipped(wrapper) is True


class TwoOptimizersClipped(LightningModule):
    """Two models behind one backward, each clipped through its wrapper, one batch = one update."""

    def __init__(self, poison_step: int = -1, precision_scale: bool = True):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)
        self.poison_step = poison_step
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y)
        poison = self.trainer.global_step == self.poison_step
        handle = self.a.weight.register_hook(lambda g: g * float("inf")) if poison else None
        self.manual_backward(loss)
        if handle is not None:
            handle.remove()
        scale = self.trainer.precision_plugin.loss_scale
        grads_a, grads_b = true_grads(self.a, scale), true_grads(self.b, scale)
        before_a, before_b = params(self.a), params(self.b)
        self.clip_gradients(opt_a, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_a.step()
        self.clip_gradients(opt_b, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_b.step()
        self.records.append(
            {"a": (before_a, params(self.a), grads_a), "b": (before_b, params(self.b), grads_b), "poison": poison}
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=LR), torch.optim.SGD(self.b.parameters(), lr=LR)

    def train_dataloader(self):
        return make_loader()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_two_optimizers_one_backward_apply_exact_clipped_updates(precision):
    model = TwoOptimizersClipped(poison_step=2)
    kwargs = {"init_scale": 2.0**10} if precision == "16-mixed" else {}
    plugin = AmpPlusPrecision(precision, **kwargs)
    make_trainer(plugins=[plugin], max_steps=8).fit(model)  # 4 batches, 2 optimizer steps each
    assert [r["poison"] for r in model.records] == [False, True, False, False]
    for record in model.records:
        before_a, after_a, grads_a = record["a"]
        before_b, after_b, grads_b = record["b"]
        if record["poison"]:
            # a's gradients overflowed: a skips (bit-identical); b's are finite and apply, as in torch's recipe,
            # unscaled with the scale they were scaled with (stock applies them 2x too large here)
            assert all(torch.equal(before_a[n], after_a[n]) for n in before_a)
        else:
            assert_sgd_update(before_a, after_a, grads_a, 0.05)
        assert_sgd_update(before_b, after_b, grads_b, 0.05)
    assert plugin.history.skipped_steps == [1]  # recorded at the logger step of its batch (the second)
    assert plugin.history.num_steps == 4
    assert plugin.applied_steps == 3
    if precision == "16-mixed":
        assert plugin.history.curve() == [(0, 1024.0), (2, 512.0)]  # backed off once for the batch (logger step 2)


class StepsTwice(LightningModule):
    """One optimizer stepping twice in one training step: two updates, each with its own scale."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(8, 1)
        self.records: list[tuple] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        xs, ys = batch[0].chunk(2), batch[1].chunk(2)
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            if self.trainer.global_step == 1:
                loss = loss * float("inf")
            self.manual_backward(loss)
            grads = true_grads(self, self.trainer.precision_plugin.loss_scale)
            before = params(self)
            opt.step()
            self.records.append((before, params(self), grads, self.trainer.global_step))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return make_loader()


def test_an_optimizer_stepping_twice_in_one_training_step_closes_the_cycle_between():
    model = StepsTwice()
    plugin = AmpPlusPrecision("16-mixed", init_scale=512.0)
    make_trainer(plugins=[plugin], max_steps=4).fit(model)
    assert plugin.history.num_steps == 4  # two updates per batch
    assert plugin.history.skipped_steps == [1]
    assert plugin.history.curve() == [(0, 512.0), (2, 256.0)]
    for index, (before, after, grads, _) in enumerate(model.records):
        if index == 1:
            assert all(torch.equal(before[n], after[n]) for n in before)
        else:
            assert_sgd_update(before, after, grads, 0.0)


def test_clip_gradients_before_the_backward_does_nothing():
    class ClipFirst(ManualSGD):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            # nothing scaled yet (step 0: no gradient at all; later: the last step's, already applied)
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            super().training_step(batch, batch_idx)

    model = ClipFirst()
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    make_trainer(plugins=[plugin], max_steps=3).fit(model)
    for record in model.records:
        assert_sgd_update(record["before"], record["after"], record["grads"], 0.05)
    assert plugin.history.num_steps == 3


# ---------------------------------------------------------------------------------------------- automatic
class AutoRecorder(Callback):
    """True gradients as ``on_before_optimizer_step`` sees them (before clipping), and the update that followed."""

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._before = params(pl_module)
        self._grads = {n: p.grad.detach().double() for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if hasattr(self, "_before"):
            self.records.append(
                (self._before, params(pl_module), self._grads, trainer.precision_plugin.history.last_step)
            )
            del self._before


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_automatic_step_applies_exactly_the_clipped_true_gradient(optimizer, accumulate, precision):
    model = TinyModel(optimizer=optimizer, lr=LR, poison={3: "inf"})
    recorder = AutoRecorder()
    kwargs = {"init_scale": 2.0**14} if precision == "16-mixed" else {}
    plugin = AmpPlusPrecision(precision, **kwargs)
    make_trainer(
        plugins=[plugin], callbacks=[recorder], max_steps=5, gradient_clip_val=0.05, accumulate_grad_batches=accumulate
    ).fit(model)
    assert plugin.history.skipped_steps == [3]
    assert len(recorder.records) == 5
    for before, after, grads, step in recorder.records:
        if step == 3:
            assert all(torch.equal(before[n], after[n]) for n in before)
        else:
            # the hook saw true gradients (a scale factor off would be 2**14 off) and the step applied them clipped
            assert max(float(g.abs().max()) for g in grads.values()) < 10
            assert_sgd_update(before, after, grads, 0.05)


def test_training_step_returning_none_runs_the_hooks_and_steps_nothing():
    class SometimesNone(TinyModel):
        def __init__(self):
            super().__init__()
            self.clip_calls: list[int] = []
            self.hook_calls: list[int] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 1 else loss

        def on_before_optimizer_step(self, optimizer):
            self.hook_calls.append(self.trainer.global_step)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_calls.append(self.trainer.global_step)
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    stock_model = SometimesNone()
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    make_trainer(plugins=[stock], max_steps=3, gradient_clip_val=1.0).fit(stock_model)
    model = SometimesNone()
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    probe = AutoRecorder()
    trainer = make_trainer(plugins=[plugin], callbacks=[probe], max_steps=3, gradient_clip_val=1.0)
    trainer.fit(model)
    # the same hooks as stock, the None batch included (Lightning counts its step in global_step)
    assert model.hook_calls == model.clip_calls == stock_model.hook_calls == stock_model.clip_calls == [0, 1, 2]
    # nothing stepped, unscaled or counted for it
    assert plugin.history.num_steps == 2
    assert plugin.history.skipped_steps == []
    assert plugin.history.last_step == 2
    before, after, _, _ = probe.records[1]
    assert all(torch.equal(before[n], after[n]) for n in before)


class _ClipThenMaybeStep(TinyModel):
    """Manual optimization that clips every batch and steps only on odd batches (a skip-on-large-norm rule, say)."""

    def __init__(self):
        super().__init__(lr=0.5)
        self.automatic_optimization = False
        self.updates = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="norm")  # unscales; clips nothing
        if batch_idx % 2 == 0:
            return  # no step this batch
        grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}
        before = {n: p.detach().clone() for n, p in self.named_parameters()}
        opt.step()
        self.updates.append((before, {n: p.detach().clone() for n, p in self.named_parameters()}, grads))
        opt.zero_grad()


def test_manual_clip_without_a_step_leaves_the_next_update_exact():
    """The batch that clipped and did not step closes without an update: the next batch's step must still apply
    exactly the true gradients it was shown (not gradients still multiplied by the scale)."""
    model = _ClipThenMaybeStep()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    with pytest.warns(AmpPlusWarning, match="in this training step but did not step"):
        make_trainer(plugins=[plugin], max_steps=2, limit_train_batches=4).fit(model)
    assert len(model.updates) == 2
    for before, after, grads in model.updates:
        for name in grads:
            assert torch.allclose(after[name], before[name] - 0.5 * grads[name], rtol=0, atol=1e-6), name
