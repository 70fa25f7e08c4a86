"""The scaler's extension points: the plugins call its public ``scale``, ``unscale_``, ``step`` and ``update``.

A user's subclass sees every call; a mock that wraps the scaler (Lightning's own AMP tests do so) counts them; a
scaler handed in (``scaler=``, ``plugin.scaler = ...``) is used, a torch ``GradScaler`` taken by its knobs and state.
Three of Lightning's own AMP tests run here in their own form, against these plugins on CPU.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
import yaml
from lightning.fabric import Fabric
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import Strategy
from torch import nn

from lightning_amp_plus import (
    AmpAdvisor,
    AmpPlusFabricPrecision,
    AmpPlusFSDPPrecision,
    AmpPlusPrecision,
    DynamicLossScaler,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    NonFiniteChecker,
    ShardedDynamicLossScaler,
)
from lightning_amp_plus.callbacks._common import plugin_arguments
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

PUBLIC = ("scale", "unscale_", "step", "update")


class CountingScaler(DynamicLossScaler):
    """Counts each public call, and who it was given (a wrapper or the optimizer itself)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: Counter = Counter()
        self.given: list = []

    def scale(self, outputs):
        self.calls["scale"] += 1
        return super().scale(outputs)

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        self.given.append(optimizer)
        super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        super().update(new_scale)


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_a_subclass_sees_each_public_call_once_per_step_with_clipping(optimizer):
    scaler = CountingScaler("cpu", init_scale=2.0**10, growth_interval=3)
    plugin = AmpPlusPrecision("16-mixed", scaler=scaler)
    assert plugin.scaler is scaler  # used as it is, not copied
    model = TinyModel(poison={2: "inf"}, optimizer=optimizer)
    make_trainer(plugins=[plugin], max_steps=6, gradient_clip_val=1.0).fit(model)
    assert dict(scaler.calls) == {"scale": 6, "unscale_": 6, "step": 6, "update": 6}
    assert plugin.history.skipped_steps == [2]  # the subclass's update is the one the history records
    real = model.trainer.optimizers[0]
    assert all(o is real for o in scaler.given)  # the plugin hands the optimizer itself


@pytest.mark.parametrize(
    ("precision", "optimizer"), [("16-mixed", "sgd"), ("16-mixed", "fused_adamw"), ("bf16-mixed", "sgd")]
)
def test_an_update_never_enters_torchs_grad_scaler_step_unscale_or_update(precision, optimizer):
    """Issue 53.3: the update path reads top to bottom in this package; torch's GradScaler serves helpers only, never
    a call that comes back into an override (its step called our unscale_ and _maybe_opt_step)."""

    def entered(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"torch.amp.GradScaler.{name} entered")

        return refuse

    model = TinyModel(poison={2: "inf"}, grad_poison={4: "net.2.weight"}, optimizer=optimizer)
    plugin = AmpPlusPrecision(precision, **({"init_scale": 2.0**10} if precision == "16-mixed" else {}))
    names = ("step", "unscale_", "update", "_maybe_opt_step", "_check_inf_per_device")
    with mock.patch.multiple(torch.amp.GradScaler, **{name: entered(name) for name in names}):
        make_trainer(plugins=[plugin], max_steps=6, gradient_clip_val=1.0).fit(model)
    assert plugin.history.skipped_steps == [2, 4]


def test_a_subclass_runs_like_the_plugins_own_scaler_bit_for_bit():
    def fit(plugin):
        torch.manual_seed(0)
        model = TinyModel(poison={3: "nan"}, grad_poison={5: "net.2.weight"})
        make_trainer(plugins=[plugin], max_steps=10, gradient_clip_val=0.5).fit(model)
        return _weights(model), plugin.history.curve(), plugin.history.skipped_steps

    own = fit(AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=2))
    given = fit(AmpPlusPrecision("16-mixed", scaler=CountingScaler("cpu", init_scale=2.0**10, growth_interval=2)))
    assert own[1:] == given[1:]
    assert all(torch.equal(own[0][n], given[0][n]) for n in own[0])


def test_manual_optimization_with_two_optimizers_and_accumulation_calls_each_once():
    class Manual(TinyModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.head = nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            a, b = self.optimizers()
            x, y = batch
            loss = nn.functional.mse_loss(self.head(self(x)).float(), y)
            self.manual_backward(loss)
            self.clip_gradients(a, gradient_clip_val=1.0)  # the LightningOptimizer: resolved by the plugin
            a.step()
            a.zero_grad()
            if batch_idx % 2 == 1:  # b accumulates over two batches
                b.step()
                b.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)

    scaler = CountingScaler("cpu", init_scale=2.0**10)
    model = Manual()
    make_trainer(plugins=[AmpPlusPrecision(scaler=scaler)], max_steps=12).fit(model)  # 8 batches: 12 steps
    assert scaler.calls["scale"] == 8
    assert scaler.calls["step"] == 12
    assert scaler.calls["unscale_"] == 12  # a's clip, and the step's own for b: once each
    assert scaler.calls["update"] == 8  # one update per batch, both optimizers' steps in it
    assert not any(isinstance(o, LightningOptimizer) for o in scaler.given)


def test_an_update_override_that_skips_super_is_a_clear_error():
    class Lost(DynamicLossScaler):
        def update(self, new_scale=None):
            pass

    trainer = make_trainer(plugins=[AmpPlusPrecision(scaler=Lost("cpu"))], max_steps=2)
    with pytest.raises(RuntimeError, match=r"`Lost.update\(\)` kept no record .* must call `super\(\).update\(\)`"):
        trainer.fit(TinyModel())


def test_an_update_override_that_sets_the_scale_through_super_is_recorded():
    class Floor(DynamicLossScaler):
        def update(self, new_scale=None):
            super().update(max(self.get_scale() * 0.5, 64.0))

    plugin = AmpPlusPrecision(scaler=Floor("cpu", init_scale=2.0**10))
    model = TinyModel(poison={1: "inf"})
    make_trainer(plugins=[plugin], max_steps=4).fit(model)
    assert plugin.history.skipped_steps == [1]  # the outcome is recorded with the caller's scale
    assert plugin.history.curve() == [(0, 1024.0), (1, 512.0), (2, 256.0), (3, 128.0)]
    assert plugin.loss_scale == 64.0


def test_a_step_override_that_returns_without_stepping_is_a_clear_error():
    class SkipAll(DynamicLossScaler):
        def step(self, optimizer, *args, **kwargs):
            return None

    model = TinyModel()
    before = _weights(model)
    trainer = make_trainer(plugins=[AmpPlusPrecision(scaler=SkipAll("cpu"))], max_steps=4)
    with pytest.raises(RuntimeError, match=r"`SkipAll.step\(\)` returned without stepping the optimizer"):
        trainer.fit(model)
    assert all(torch.equal(before[n], w) for n, w in _weights(model).items())


# ---------------------------------------------------------------------------- mocks, as Lightning's tests use them
def test_wrapping_the_scaler_in_a_mock_counts_every_call_and_changes_nothing(tmp_path):
    def fit(wrap):
        torch.manual_seed(0)
        plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=2)
        callbacks = [LossScaleMonitor(), NaNSkipReporter(), GradUnderflowMonitor(), AmpAdvisor(print_advice=False)]
        logger = CSVLogger(tmp_path, name=str(wrap))
        trainer = make_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=6, gradient_clip_val=1.0)
        if wrap:
            trainer.precision_plugin.scaler = Mock(wraps=trainer.precision_plugin.scaler)
        model = TinyModel(poison={1: "inf"})
        trainer.fit(model)
        return plugin, _weights(model), callbacks[-1].advice

    plain, plain_weights, plain_advice = fit(False)
    wrapped, wrapped_weights, wrapped_advice = fit(True)
    assert [a.code for a in wrapped_advice] == [a.code for a in plain_advice]
    for name in PUBLIC:
        assert getattr(wrapped.scaler, name).call_count == 6, name
    assert wrapped.history.curve() == plain.history.curve()
    assert wrapped.history.skipped_steps == plain.history.skipped_steps == [1]
    assert all(torch.equal(plain_weights[n], wrapped_weights[n]) for n in plain_weights)


def test_patching_one_method_of_the_instance_counts_it():
    plugin = AmpPlusPrecision("16-mixed")
    with mock.patch.object(plugin.scaler, "step", wraps=plugin.scaler.step) as step:
        make_trainer(plugins=[plugin], max_steps=6).fit(TinyModel())
    assert step.call_count == 6


def test_lightnings_skip_training_step_with_grad_scaler_in_its_own_form():
    """tests_pytorch/plugins/precision/test_amp_integration.py, on CPU with this plugin."""

    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None  # skipping the backward should skip the grad scaler too
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed")], barebones=True, max_steps=5, gradient_clip_val=0.5)
    assert isinstance(trainer.precision_plugin, AmpPlusPrecision)
    assert trainer.precision_plugin.scaler is not None
    trainer.precision_plugin.scaler = Mock(wraps=trainer.precision_plugin.scaler)
    trainer.fit(TestModel())
    assert trainer.precision_plugin.scaler.unscale_.call_count == 3
    assert trainer.precision_plugin.scaler.step.call_count == 3
    assert trainer.precision_plugin.scaler.update.call_count == 3


def test_lightnings_multiple_optimizers_manual_call_counts_in_its_own_form(tmp_path):
    """tests_pytorch/trainer/optimization/test_manual_optimization.py, 16-mixed on CPU with this plugin."""

    class ManualOptModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            loss_1 = self.step(batch[0])
            self.manual_backward(loss_1)
            opt_a.step()
            opt_a.zero_grad()
            loss_2 = self.step(batch[0])
            self.manual_backward(loss_2, retain_graph=True)
            self.manual_backward(loss_2)
            assert self.layer.weight.grad is not None
            opt_b.step()
            opt_b.zero_grad()
            return loss_2

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)

    model = ManualOptModel()
    limit_train_batches = 2
    trainer = make_trainer(
        default_root_dir=tmp_path,
        plugins=[AmpPlusPrecision("16-mixed")],
        limit_train_batches=limit_train_batches,
        limit_val_batches=0,
        max_epochs=1,
        max_steps=-1,
        log_every_n_steps=1,
    )
    scaler_step_patch = mock.patch.object(
        trainer.precision_plugin.scaler, "step", wraps=trainer.precision_plugin.scaler.step
    )
    scaler_step = scaler_step_patch.start()
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as bwd_mock:
        trainer.fit(model)
    assert bwd_mock.call_count == limit_train_batches * 3
    assert trainer.global_step == limit_train_batches * 2
    scaler_step_patch.stop()
    assert scaler_step.call_count == len(model.optimizers()) * limit_train_batches


def test_fabrics_amp_precision_backward_and_optimizer_step_with_scaler_in_their_own_form():
    """tests_fabric/plugins/precision/test_amp.py, with a real scaler wrapped (the step needs real gradients)."""
    precision = AmpPlusFabricPrecision(precision="16-mixed", device="cpu")
    precision.scaler = Mock(wraps=precision.scaler)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.forward_context():
        tensor = model(torch.randn(8, 4)).float().pow(2).mean()
    precision.backward(tensor, model)
    precision.scaler.scale.assert_called_once_with(tensor)
    precision.optimizer_step(optimizer)
    precision.scaler.step.assert_called_once_with(optimizer)
    precision.scaler.update.assert_called_once()
    precision.scaler.unscale_.assert_called_once_with(optimizer)


def test_fabric_calls_a_subclass_through_fabric_clip_gradients():
    scaler = CountingScaler("cpu", init_scale=2.0**10)
    plugin = AmpPlusFabricPrecision("16-mixed", scaler=scaler)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    model, optimizer = fabric.setup(nn.Linear(4, 1), torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(4):
        fabric.backward(model(torch.randn(8, 4)).float().pow(2).mean())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert dict(scaler.calls) == {"scale": 4, "unscale_": 4, "step": 4, "update": 4}


# ------------------------------------------------------------------------------------ scaler= and plugin.scaler
def _stock_fit(scaler, steps=12):
    torch.manual_seed(0)
    model = TinyModel(poison={2: "inf", 7: "nan"})
    stock = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    make_trainer(plugins=[stock], max_steps=steps, gradient_clip_val=1.0).fit(model)
    return _weights(model), scaler.get_scale()


def test_a_torch_grad_scaler_is_taken_with_its_knobs_and_runs_as_stock_bit_for_bit():
    make = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_factor=4.0, growth_interval=3)  # noqa: E731
    stock_weights, stock_scale = _stock_fit(make())
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", scaler=make())
    model = TinyModel(poison={2: "inf", 7: "nan"})
    make_trainer(plugins=[plugin], max_steps=12, gradient_clip_val=1.0).fit(model)
    assert type(plugin.scaler) is DynamicLossScaler
    assert plugin.scaler.knobs() == {
        "init_scale": 2.0**12,
        "growth_factor": 4.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "min_scale": 0.0,
        "max_scale": math.inf,
        "hysteresis": 1,
    }
    assert plugin.loss_scale == stock_scale
    assert plugin.history.skipped_steps == [2, 7]
    weights = _weights(model)
    assert all(torch.equal(stock_weights[n], weights[n]) for n in weights)


def test_a_used_grad_scaler_brings_its_scale_and_growth_tracker():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    used = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    for bad in (True, False, False):
        used.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
        used.step(opt)
        used.update()
        opt.zero_grad()
    plugin = AmpPlusPrecision("16-mixed", scaler=used)
    assert plugin.scaler.get_scale() == used.get_scale() == 512.0
    assert plugin.scaler.state_dict()["_growth_tracker"] == used.state_dict()["_growth_tracker"] == 2
    assert plugin.scaler is not used


def _used_grad_scaler():
    """A GradScaler two clean updates into its growth interval of 3, its scale backed off once to 512."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    used = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for bad in (True, False, False):
        used.scale(model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)).backward()
        used.step(opt)
        used.update()
        opt.zero_grad()
    return used


def test_a_fit_starts_from_a_used_grad_scalers_state_as_stock_does_bit_for_bit():
    stock_weights, stock_scale = _stock_fit(_used_grad_scaler(), steps=6)
    plugin = AmpPlusPrecision("16-mixed", scaler=_used_grad_scaler())
    torch.manual_seed(0)
    model = TinyModel(poison={2: "inf", 7: "nan"})
    make_trainer(plugins=[plugin], max_steps=6, gradient_clip_val=1.0).fit(model)
    assert plugin.history.curve()[0] == (0, 512.0)
    assert plugin.loss_scale == stock_scale
    weights = _weights(model)
    assert all(torch.equal(stock_weights[n], weights[n]) for n in weights)


def test_a_loaded_scaler_given_as_it_is_starts_each_new_fit_from_its_state():
    def loaded():
        scaler = CountingScaler("cpu", init_scale=2.0**10, growth_interval=3)
        scaler.load_state_dict({**scaler.state_dict(), "scale": 256.0, "_growth_tracker": 2})
        return scaler

    stock = loaded()
    make_trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=stock)], max_steps=1).fit(TinyModel())
    plugin = AmpPlusPrecision(scaler=loaded())
    make_trainer(plugins=[plugin], max_steps=1).fit(TinyModel())
    assert plugin.loss_scale == stock.get_scale() == 512.0  # its third clean update grew it
    make_trainer(plugins=[plugin], max_steps=1).fit(TinyModel())  # a new Trainer: from the state as given again
    assert plugin.history.curve() == [(0, 256.0)]
    assert plugin.loss_scale == 512.0


def test_a_given_grad_scaler_prints_as_the_scaler_in_use():
    plugin = AmpPlusPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    shown = "scaler=DynamicLossScaler(device='cpu', init_scale=1024.0, min_scale=0.0, max_scale=inf)"
    assert repr(plugin) == f"AmpPlusPrecision({shown})"
    later = AmpPlusPrecision("16-mixed", growth_interval=7)
    later.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert repr(later) == f"AmpPlusPrecision({shown})"


def test_the_fsdp_plugin_takes_a_sharded_scaler_and_refuses_an_unsharded_one():
    sharded = ShardedDynamicLossScaler("cpu", init_scale=2.0**8)
    assert AmpPlusFSDPPrecision("16-mixed", scaler=sharded).scaler is sharded
    taken = AmpPlusFSDPPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8)).scaler
    assert type(taken) is ShardedDynamicLossScaler
    assert taken.get_scale() == 256.0
    with pytest.raises(TypeError, match=r"each rank holds a shard .* HINT: use `ShardedDynamicLossScaler`"):
        AmpPlusFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cpu"))


class OwnGradScaler(torch.amp.GradScaler):
    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer, *args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"precision": "bf16-mixed", "scaler": DynamicLossScaler("cpu")},
            ValueError,
            r"`AmpPlusPrecision\(precision='bf16-mixed', scaler=DynamicLossScaler\(...\)\)` is invalid: bf16-mixed",
        ),
        (
            {"scaler": DynamicLossScaler("cpu"), "growth_interval": 10},
            ValueError,
            r"`AmpPlusPrecision\(scaler=..., growth_interval=10\)` is invalid: the scaler given holds its own knobs",
        ),
        ({"scaler": "cpu"}, TypeError, r"`AmpPlusPrecision\(scaler=str\(...\)\)` is invalid: expected a"),
        (
            {"scaler": OwnGradScaler("cpu")},
            TypeError,
            r"scaler=OwnGradScaler\(...\)\)` is invalid: its own methods would not run .* subclass `DynamicLossScaler`",
        ),
        (
            {"scaler": torch.amp.GradScaler("cpu", enabled=False)},
            ValueError,
            r"scaler=GradScaler\('cpu', ...\)\)` is invalid: the scaler is disabled \(`enabled=False`, or torch turned"
            r" it off: no 'cpu' device here\), and a disabled scaler scales nothing",
        ),
        ({"scaler": DynamicLossScaler("cpu", enabled=False)}, ValueError, r"a disabled scaler scales nothing"),
        ({"scaler": Mock(spec=DynamicLossScaler)}, TypeError, r"a mock stands in for a scaler only when it wraps one"),
        ({"scaler": NonFiniteChecker()}, TypeError, r"a `NonFiniteChecker` never scales"),
        ({"scaler": Mock()}, TypeError, r"a mock stands in for a scaler only when it wraps one"),
    ],
)
def test_a_scaler_that_cannot_serve_is_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        AmpPlusPrecision(**kwargs)


def test_setting_the_scaler_checks_it_as_the_argument_does():
    plugin = AmpPlusPrecision("16-mixed")
    with pytest.raises(ValueError, match=r"`AmpPlusPrecision.scaler = None` is invalid: 16-mixed needs a loss scaler"):
        plugin.scaler = None
    with pytest.raises(TypeError, match=r"scaler=int\(...\)\)` is invalid"):
        plugin.scaler = 3
    mine = CountingScaler("cpu", init_scale=2.0**8)
    plugin.scaler = mine
    assert plugin.scaler is mine
    assert plugin.engine.checker is mine
    bf16 = AmpPlusPrecision("bf16-mixed")
    bf16.scaler = None  # as it is
    with pytest.raises(ValueError, match="bf16-mixed uses no loss scaler"):
        bf16.scaler = DynamicLossScaler("cpu")


def test_the_logged_call_names_the_given_scalers_knobs(tmp_path):
    plugin = AmpPlusPrecision("16-mixed", scaler=CountingScaler("cpu", init_scale=2.0**12, hysteresis=2))
    assert repr(plugin) == "AmpPlusPrecision(scaler=CountingScaler(device='cpu', init_scale=4096.0, hysteresis=2))"
    assert plugin_arguments(plugin) == {"init_scale": 2.0**12, "hysteresis": 2}
    set_later = AmpPlusPrecision("16-mixed", growth_interval=7)
    set_later.scaler = DynamicLossScaler("cpu", max_scale=2.0**20)
    assert plugin_arguments(set_later) == {"max_scale": 2.0**20}  # the knobs given before belong to the old one
    logger = CSVLogger(tmp_path, name="run")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor()], logger=logger, max_steps=2).fit(TinyModel())
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        logged = yaml.safe_load(f)["amp/plugin"]
    assert logged == 'AmpPlusPrecision("16-mixed", init_scale=2.0**12, hysteresis=2)'


# ------------------------------------------------------------------------------------ 0.3: the checks that must hold
def test_an_update_override_that_calls_super_only_on_some_updates_is_the_same_clear_error():
    """Its other updates would leave the last record in place: read as the update's, it would be recorded twice."""

    class EveryOther(DynamicLossScaler):
        updates = 0

        def update(self, new_scale=None):
            self.updates += 1
            if self.updates % 2:
                super().update(new_scale)

    scaler = EveryOther("cpu")
    trainer = make_trainer(plugins=[AmpPlusPrecision(scaler=scaler)], max_steps=4)
    with pytest.raises(
        RuntimeError, match=r"`EveryOther.update\(\)` kept no record .* must call `super\(\).update\(\)`"
    ):
        trainer.fit(TinyModel())
    assert scaler.updates == 2  # at the first update that skipped `super()`


def test_the_logged_call_of_a_used_grad_scaler_starts_at_its_scale():
    used = _used_grad_scaler()  # backed off 1024 -> 512
    plugin = AmpPlusPrecision("16-mixed", scaler=used)
    assert plugin_arguments(plugin)["init_scale"] == 512.0
    assert "init_scale=512.0" in repr(plugin)


def test_a_sharded_grad_scaler_given_to_the_fsdp_plugin_keeps_its_process_group(monkeypatch):
    """HSDP: the overflow flag is reduced over the scaler's group (a replica's shards), not over the world."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from tests.helpers.sharded import FakePeer

    group = object()
    plugin = AmpPlusFSDPPrecision("16-mixed", scaler=ShardedGradScaler("cpu", init_scale=2.0**10, process_group=group))
    assert type(plugin.scaler) is ShardedDynamicLossScaler
    assert plugin.scaler.process_group is group
    peer = FakePeer(monkeypatch, lambda tensor, op: torch.zeros_like(tensor))
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    plugin.scaler.step(opt)
    plugin.scaler.update()
    assert [c["group"] for c in peer.calls] == [group]


def test_setting_an_unsharded_scaler_on_the_fsdp_plugin_is_refused_as_the_constructor_does():
    plugin = AmpPlusFSDPPrecision("16-mixed")
    before = plugin.scaler
    with pytest.raises(
        TypeError,
        match=r"^`AmpPlusFSDPPrecision\(scaler=DynamicLossScaler\(device='cpu'\)\)` is invalid: each rank holds",
    ):
        plugin.scaler = DynamicLossScaler("cpu")
    assert plugin.scaler is before
    plugin.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    assert type(plugin.scaler) is ShardedDynamicLossScaler


def test_a_mock_wrapping_a_disabled_scaler_is_refused_like_the_scaler_itself():
    wrapped = Mock(wraps=DynamicLossScaler("cpu", enabled=False))
    refused = r"is invalid: the scaler is disabled .* a disabled scaler scales nothing"
    with pytest.raises(ValueError, match=refused):
        AmpPlusPrecision("16-mixed", scaler=wrapped)
    plugin = AmpPlusPrecision("16-mixed")
    with pytest.raises(ValueError, match=refused):
        plugin.scaler = wrapped


class _Seen(TinyModel):
    def __init__(self, order):
        super().__init__()
        self.order = order

    def on_train_batch_start(self, batch, batch_idx):
        self.order.append("module hook")

    def training_step(self, batch, batch_idx):
        self.order.append("training_step")
        return super().training_step(batch, batch_idx)


def test_a_listeners_step_starting_is_called_once_a_step_after_every_hook_before_the_step():
    from lightning_amp_plus import UpdateListener

    order = []

    class Starting(UpdateListener):
        def step_starting(self):
            order.append("step_starting")

    plugin = AmpPlusPrecision("16-mixed")
    plugin.listen(Starting())
    make_trainer(plugins=[plugin], max_steps=3).fit(_Seen(order))
    assert order == ["module hook", "step_starting", "training_step"] * 3
    plugin.engine.clear_listeners()
    plugin.listen(UpdateListener())  # a listener that does not override it is not called at all
    assert plugin.engine.step_starting == []
