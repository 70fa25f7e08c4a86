from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, DynamicLossScaler, ScaleHistory
from tests.helpers.models import TinyModel, make_loader, total_norm
from tests.helpers.trainer import StepProbe, make_trainer


class DtypeProbe(TinyModel):
    def training_step(self, batch, batch_idx):
        self.out_dtype = self(batch[0]).dtype
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_autocast_on_cpu_in_the_chosen_dtype(precision, dtype):
    model = DtypeProbe()
    plugin = AmpPlusPrecision(precision)
    trainer = make_trainer(plugins=[plugin], max_steps=1)
    trainer.fit(model)
    assert model.out_dtype == dtype
    assert plugin.device == "cpu"
    assert trainer.precision == precision
    assert isinstance(plugin.scaler, DynamicLossScaler) if precision == "16-mixed" else plugin.scaler is None
    assert isinstance(plugin.history, ScaleHistory)


@pytest.mark.parametrize("available", [False, True])
def test_autocast_before_a_trainer_set_the_device_guesses_it_as_torch_does(monkeypatch, available):
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch, "autocast", lambda device, **kwargs: made.append((device, kwargs["dtype"])))
    plugin = AmpPlusPrecision("bf16-mixed")  # no trainer yet: no device
    plugin.autocast_context_manager()
    assert made == [("cuda" if available else "cpu", torch.bfloat16)]
    assert plugin.device is None  # a guess for this context only: the trainer's device is set at connect


def test_a_second_forward_after_a_step_in_one_training_step_sees_the_new_weights():
    """One autocast region spans a manual ``training_step``: a cast of a weight kept from before the step would be
    stale (autocast's weight-cast cache); the second forward must compute with the updated weights."""
    seen = {}

    class StepThenForward(TinyModel):
        def __init__(self):
            super().__init__(lr=0.5)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            seen["after"] = self(x).float()
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                seen["fresh"] = self(x).float()  # the same weights cast anew

    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0)], max_steps=1).fit(StepThenForward())
    assert torch.equal(seen["after"], seen["fresh"])


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("optimizer", ["adam", "fused_adamw", "sgd"])
def test_overflowing_loss_skips_step_bit_identically(kind, optimizer):
    seed_everything(0)
    model = TinyModel(poison={2: kind, 5: kind}, optimizer=optimizer, lr=0.01)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    probe = StepProbe()
    trainer = make_trainer(plugins=[plugin], callbacks=[probe], max_steps=8, gradient_clip_val=1.0)
    trainer.fit(model)
    assert probe.unchanged == [2, 5]
    assert plugin.history.skipped_steps == [2, 5]
    assert plugin.history.scale_at(2) == 2.0**10
    assert plugin.history.scale_at(3) == 2.0**9
    assert plugin.history.scale_at(6) == 2.0**8
    assert plugin.applied_steps == 6
    assert trainer.global_step == 8


def test_poisoned_parameter_gradient_skips_the_step():
    model = TinyModel(grad_poison={3: "net.2.bias"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    probe = StepProbe()
    trainer = make_trainer(plugins=[plugin], callbacks=[probe], max_steps=6)
    trainer.fit(model)
    assert probe.unchanged == [3]
    assert plugin.history.skipped_steps == [3]


def _seen_grads(init_scale: float, **trainer_kwargs: Any) -> list[dict[str, torch.Tensor]]:
    seed_everything(1)
    model = TinyModel()
    plugin = AmpPlusPrecision("16-mixed", init_scale=init_scale)
    make_trainer(plugins=[plugin], max_steps=3, **trainer_kwargs).fit(model)
    return model.seen_grads


@pytest.mark.parametrize("accumulate", [1, 3])
def test_hooks_see_true_gradients(accumulate):
    small = _seen_grads(1.0, accumulate_grad_batches=accumulate)
    large = _seen_grads(2.0**14, accumulate_grad_batches=accumulate)
    assert len(small) == len(large) == 3  # once per optimizer step, not per accumulated batch
    for a, b in zip(small, large, strict=False):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=2e-2, atol=1e-4)


class ClipProbe(TinyModel):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.norm_before = total_norm([p.grad for p in self.parameters()])
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norm_after = total_norm([p.grad for p in self.parameters()])


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw", "fused_sgd"])
def test_clipping_acts_on_true_gradients(optimizer):
    model = ClipProbe(optimizer=optimizer, lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**16)
    make_trainer(plugins=[plugin], max_steps=2, gradient_clip_val=0.05).fit(model)
    assert 0.05 < model.norm_before < 100  # a true gradient norm, not one scaled by 65536
    torch.testing.assert_close(model.norm_after, torch.tensor(0.05), rtol=1e-3, atol=0)


def test_stock_lightning_refuses_what_we_support():
    model = ClipProbe(optimizer="fused_adamw")
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        make_trainer(plugins=[stock], max_steps=1, gradient_clip_val=0.05).fit(model)


class ManualClip(LightningModule):
    def __init__(self, poison_step: int = -1):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(8, 1)
        self.norms: list[tuple[float, float]] = []
        self.poison_step = poison_step

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
        if self.global_step == self.poison_step:
            loss = loss * float("inf")
        self.manual_backward(loss)
        before = float(total_norm([p.grad for p in self.parameters()]))
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        after = float(total_norm([p.grad for p in self.parameters()]))
        self.norms.append((before, after))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return make_loader()


def test_manual_optimization_clips_true_gradients():
    model = ManualClip(poison_step=2)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    make_trainer(plugins=[plugin], max_steps=4).fit(model)
    clean = [n for i, n in enumerate(model.norms) if i != 2]
    for before, after in clean:
        assert before > 1.0  # the scaled gradient, as `manual_backward` leaves it
        assert after == pytest.approx(0.01, rel=1e-3)  # clipped after unscaling: a true norm of 0.01
    assert plugin.history.skipped_steps == [2]
    assert plugin.history.curve() == [(0, 1024.0), (3, 512.0)]


class TwoOptimizers(LightningModule):
    """Two models behind one backward; an overflow in the first optimizer's parameters only."""

    def __init__(self, poison_step: int):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)
        self.poison_step = poison_step
        self.deltas: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y)
        poison = self.trainer.global_step == self.poison_step
        if poison:
            handle = self.a.weight.register_hook(lambda g: g * float("inf"))
        self.manual_backward(loss)
        if poison:
            handle.remove()
        opt_a.step()
        grad_b = self.b.weight.grad.detach().clone()  # still scaled here: unscaled inside opt_b.step()
        before = self.b.weight.detach().clone()
        opt_b.step()
        self.deltas.append((self.b.weight.detach() - before, grad_b))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

    def train_dataloader(self):
        return make_loader()


@pytest.mark.parametrize("use_stock", [False, True])
def test_two_optimizers_one_backward_update_once_per_batch(use_stock):
    init = 2.0**12
    model = TwoOptimizers(poison_step=0)
    if use_stock:
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init))
    else:
        plugin = AmpPlusPrecision("16-mixed", init_scale=init)
    make_trainer(plugins=[plugin], max_steps=2).fit(model)  # one batch: two optimizer steps
    delta, scaled_grad = model.deltas[0]
    expected = -0.1 * scaled_grad / init
    if use_stock:
        # the documented stock bug: the scale backed off between the two steps, b's update came out 2x too large
        assert plugin.scaler.get_scale() == init / 2
        torch.testing.assert_close(delta, 2 * expected, rtol=1e-3, atol=1e-7)
    else:
        assert plugin.scaler.get_scale() == init / 2  # backed off once, not twice
        torch.testing.assert_close(delta, expected, rtol=1e-3, atol=1e-7)
        assert plugin.history.curve() == [(0, init)]
        assert plugin.history.skipped_steps == [0]


def test_two_overflows_back_off_once_per_batch_not_per_step():
    model = TwoOptimizers(poison_step=-1)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)

    class Both(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            self.poison_step = self.trainer.global_step  # every batch overflows in `a`
            return super().training_step(batch, batch_idx)

    model = Both(poison_step=-1)
    make_trainer(plugins=[plugin], max_steps=6).fit(model)  # 3 batches
    assert plugin.scaler.get_scale() == 1024.0 / 8
    assert plugin.history.skipped_steps == [0, 1, 2]  # one update per batch, at the logger step


def test_checkpoint_carries_scaler_and_history(tmp_path):
    model = TinyModel(poison={1: "inf"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=64.0, growth_interval=3, hysteresis=2)
    trainer = make_trainer(plugins=[plugin], max_steps=5)
    trainer.fit(model)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["AmpPlusPrecision"]
    assert state["_hysteresis_tracker"] == 2  # refilled by the growth at step 4
    assert state["scale"] == 128.0
    assert ckpt["MixedPrecision"]["scale"] == 128.0  # stock Lightning finds it under its own key too
    assert state["history"]["skipped_steps"] == [1]
    fresh = AmpPlusPrecision("16-mixed")
    fresh.load_state_dict(state)
    assert fresh.scaler.get_scale() == 128.0
    assert fresh.history.skipped_steps == [1]
    assert fresh.scaler.hysteresis == 2


def test_bf16_skips_nonfinite_gradients_by_default():
    model = TinyModel(poison={2: "nan"})
    plugin = AmpPlusPrecision("bf16-mixed")
    probe = StepProbe()
    make_trainer(plugins=[plugin], callbacks=[probe], max_steps=5).fit(model)
    assert probe.unchanged == [2]
    assert plugin.history.skipped_steps == [2]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.history.curve() == [(0, 1.0)]


@pytest.mark.parametrize("optimizer", ["fused_adamw", "adam"])
def test_bf16_skip_with_fused_and_plain_optimizers(optimizer):
    model = TinyModel(poison={1: "inf"}, optimizer=optimizer, lr=1e-3)
    plugin = AmpPlusPrecision("bf16-mixed")
    probe = StepProbe()
    make_trainer(plugins=[plugin], callbacks=[probe], max_steps=3).fit(model)
    assert probe.unchanged == [1]
    assert plugin.history.skipped_steps == [1]


def test_bf16_skip_can_be_turned_off():
    model = TinyModel(poison={2: "nan"})
    plugin = AmpPlusPrecision("bf16-mixed", skip_nonfinite=False)
    make_trainer(plugins=[plugin], max_steps=3).fit(model)
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # stock behaviour: NaN in the weights
    assert plugin.history.skipped_steps == []


def test_lbfgs_is_refused_under_16_mixed():
    model = TinyModel(optimizer="lbfgs")
    with pytest.raises(ValueError, match=r"cannot train with `torch.optim.LBFGS`.*HINT"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], max_steps=1).fit(model)


def test_step_was_skipped_is_exposed():
    model = TinyModel(poison={2: "inf"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    flags = []

    class Probe(StepProbe):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flags.append(plugin.optimizer_step_was_skipped)

    make_trainer(plugins=[plugin], callbacks=[Probe()], max_steps=4).fit(model)
    assert flags == [False, False, True, False]
    assert plugin.applied_steps == 3


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            ("32-true",),
            {},
            ValueError,
            r"^`AmpPlusPrecision\(precision='32-true'\)` is invalid: expected one of '16-mixed', 'bf16-mixed'\. HINT:"
            r" for fp32 leave the plugin out; for pure half precision use Lightning's `precision='16-true'`\.$",
        ),
        (
            ("bf16-mixed",),
            {"init_scale": 8.0, "growth_interval": 5},
            ValueError,
            r"^`AmpPlusPrecision\(precision='bf16-mixed', init_scale=8\.0, growth_interval=5\)` is invalid: bf16",
        ),
        (
            ("bf16-mixed",),
            {"skip_nonfinite": "yes"},
            TypeError,
            r"^`AmpPlusPrecision\(skip_nonfinite='yes'\)` is invalid: expected a bool, got str\.$",
        ),
        (("16",), {}, ValueError, r"expected one of '16-mixed', 'bf16-mixed'. HINT"),
        (("bf16-mixed",), {"init_scale": 8.0}, ValueError, r"bf16-mixed', init_scale=8.0\)` is invalid: bf16-mixed"),
        (("16-mixed",), {"skip_nonfinite": False}, ValueError, r"skip_nonfinite=False\)` is invalid"),
        (("16-mixed",), {"backoff_factor": 2.0}, ValueError, r"`AmpPlusPrecision\(backoff_factor=2.0\)` is invalid"),
        (("16-mixed",), {"growth_interval": 0}, ValueError, r"`AmpPlusPrecision\(growth_interval=0\)` is invalid"),
        (("16-mixed", 3), {}, TypeError, r"`AmpPlusPrecision\(device=3\)` is invalid"),
        pytest.param(
            ("16-mixed", "cuda"),
            {},
            ValueError,
            r"`AmpPlusPrecision\(device='cuda'\)` is invalid: CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        (
            ("16-mixed",),
            {"skip_scheduler_on_overflow": "yes"},
            TypeError,
            r"^`AmpPlusPrecision\(skip_scheduler_on_overflow='yes'\)` is invalid: expected a bool, got str\.$",
        ),
    ],
)
def test_bad_arguments_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        AmpPlusPrecision(*args, **kwargs)


@pytest.mark.requires_cuda
def test_cuda_fp16_skip_and_clip():
    model = ClipProbe(poison={1: "inf"}, optimizer="fused_adamw", lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], accelerator="cuda", max_steps=3, gradient_clip_val=0.05).fit(model)
    assert plugin.device == "cuda"
    assert plugin.history.skipped_steps == [1]


def test_gan_loop_updates_once_per_batch(tmp_path, capsys):
    from examples.gan_manual import main

    plugin = main(["--fast", "--out", str(tmp_path)])  # 4 batches, two optimizer steps and two backward calls each
    assert "gap between generated and real means: " in capsys.readouterr().out
    assert plugin.history.num_steps == 4
    assert [s for s, _ in plugin.history.curve()] == [0]


def test_clipping_without_stepping_warns():
    class ClipNoStep(ManualClip):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.net(batch[0]).float(), batch[1]))
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            if batch_idx % 2 == 1:
                opt.step()
                opt.zero_grad()

    with pytest.warns(UserWarning, match=r"\(by `clip_gradients` or `unscale_`\) in this training step but did not"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], max_steps=2).fit(ClipNoStep())


def test_the_logger_step_outside_a_fit_is_none():
    from lightning_amp_plus.precision import logger_step

    assert logger_step(None) is None
    assert logger_step(TinyModel()) is None  # not attached to a trainer


@pytest.mark.parametrize("plugin_class", ["AmpPlusPrecision", "AmpPlusFabricPrecision"])
def test_signatures_show_the_real_defaults_the_scaler_uses(plugin_class):
    """`help()`, IDEs and `--print_config` show `growth_factor: 2.0`, never `null`; one set of values everywhere."""
    import inspect

    import lightning_amp_plus
    from lightning_amp_plus import DynamicLossScaler
    from lightning_amp_plus.engine import SCALER_DEFAULTS

    plugin = inspect.signature(getattr(lightning_amp_plus, plugin_class)).parameters
    scaler = inspect.signature(DynamicLossScaler).parameters
    for name, value in SCALER_DEFAULTS.items():
        assert plugin[name].default == scaler[name].default == value, name
    built = getattr(lightning_amp_plus, plugin_class)("16-mixed", "cpu").scaler.knobs()
    assert built == SCALER_DEFAULTS
