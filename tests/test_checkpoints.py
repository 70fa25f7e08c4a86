"""Checkpoints: portable to and from stock Lightning (Trainer and Fabric), validated, precision switches said."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp_plus import AmpPlusFabricPrecision, AmpPlusPrecision
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


def _stock(init_scale=2.0**10):
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def _fit(plugin, tmp_path, name, max_steps, poison=None, ckpt_path=None):
    model = TinyModel(poison=poison or {})
    trainer = make_trainer(plugins=[plugin], max_steps=max_steps)
    trainer.fit(model, ckpt_path=ckpt_path)
    path = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_a_stock_run_resumes_under_our_plugin_at_the_stock_scale(tmp_path):
    path = _fit(_stock(), tmp_path, "stock", 4, poison={1: "inf", 2: "inf"})  # stock backs off to 256
    assert torch.load(path, weights_only=False)["MixedPrecision"]["scale"] == 256.0
    ours = AmpPlusPrecision("16-mixed")  # would start at 65536
    _fit(ours, tmp_path, "ours", 6, ckpt_path=path)
    assert ours.history.curve() == [(4, 256.0)]  # resumed at the stock run's scale
    assert ours.loss_scale == 256.0


def test_our_run_resumes_under_stock_at_our_scale(tmp_path):
    ours = AmpPlusPrecision("16-mixed", init_scale=2.0**10, hysteresis=2)
    path = _fit(ours, tmp_path, "ours", 4, poison={1: "inf", 2: "inf"})
    assert ours.loss_scale == 512.0
    stock = _stock(init_scale=2.0**16)
    _fit(stock, tmp_path, "stock", 5, ckpt_path=path)  # stock's own `load_state_dict` takes our state
    assert stock.scaler.get_scale() == 512.0


def test_our_run_resumes_under_our_plugin_from_our_own_key(tmp_path):
    first = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=3)
    path = _fit(first, tmp_path, "ours", 4, poison={1: "inf"})
    again = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=3)
    _fit(again, tmp_path, "again", 6, ckpt_path=path)
    assert again.history.skipped_steps == [1]  # the history came along: our key, not the stock copy
    assert again.history.num_steps == 6


@pytest.mark.parametrize("direction", ["stock->ours", "ours->stock"])
def test_fabric_states_load_both_ways(direction):
    ours = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**10)
    stock = FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    src, dst = (stock, ours) if direction == "stock->ours" else (ours, stock)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[src])
    model, opt = fabric.setup(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    opt.step()
    expected = src.scaler.get_scale()
    assert expected in (2.0**15, 2.0**9)
    dst.load_state_dict(src.state_dict())
    assert dst.scaler.get_scale() == expected


def test_a_16_mixed_state_resumed_as_bf16_is_a_said_conversion(tmp_path, caplog):
    path = _fit(AmpPlusPrecision("16-mixed", init_scale=2.0**10), tmp_path, "fp16", 3)
    bf16 = AmpPlusPrecision("bf16-mixed")
    _fit(bf16, tmp_path, "bf16", 5, ckpt_path=path)
    assert (
        "resuming a 16-mixed state under bf16-mixed: its loss scaler's state (scale 1024.0) is dropped" in caplog.text
    )
    assert bf16.history.curve() == [(0, 1024.0), (3, 1.0)]  # the history continues, the switch visible


def test_a_bf16_state_resumed_as_16_mixed_starts_at_init_scale_and_says_so(tmp_path, caplog):
    path = _fit(AmpPlusPrecision("bf16-mixed"), tmp_path, "bf16", 3)
    fp16 = AmpPlusPrecision("16-mixed", init_scale=2.0**8)
    _fit(fp16, tmp_path, "fp16", 5, ckpt_path=path)
    assert "resuming a bf16-mixed state under 16-mixed: the loss scale starts at init_scale=256" in caplog.text
    assert fp16.history.curve() == [(0, 1.0), (3, 256.0)]


def _good_state():
    plugin = AmpPlusPrecision("16-mixed", init_scale=64.0)
    make_trainer(plugins=[plugin], max_steps=2).fit(TinyModel())
    return plugin.state_dict()


@pytest.mark.parametrize(
    ("corrupt", "error", "match"),
    [
        (lambda s: None, TypeError, r"`checkpoint\['AmpPlusPrecision'\]` is invalid: expected a dict"),
        (lambda s: {**s, "scale": 0.0}, ValueError, r"load_state_dict\(scale=0.0\)` is invalid"),
        (lambda s: {**s, "scale": float("nan")}, ValueError, r"load_state_dict\(scale=nan\)` is invalid"),
        (lambda s: {k: v for k, v in s.items() if k != "scale"}, ValueError, r"a 16-mixed state needs the scaler"),
        (lambda s: {**s, "precision": "fp8"}, ValueError, r"\['precision'\]='fp8'` is invalid"),
        (lambda s: {**s, "history": None}, TypeError, r"\['history'\]` is invalid: expected a dict"),
        (lambda s: {**s, "history": {**s["history"], "version": 9}}, ValueError, r"\['version'\]=9` is invalid"),
        (
            lambda s: {**s, "history": {**s["history"], "change_scales": [0.0]}},
            ValueError,
            r"\['change_scales'\]=\[0.0\]` is invalid",
        ),
        (
            lambda s: {**s, "history": {**s["history"], "skipped_steps": [3, 1]}},
            ValueError,
            r"\['skipped_steps'\]=\[3, 1\]` is invalid: expected increasing ints",
        ),
        (lambda s: {**s, "history": {**s["history"], "num_steps": -1}}, ValueError, r"\['num_steps'\]=-1` is invalid"),
    ],
)
def test_corrupt_plugin_states_are_refused_with_the_key_named(corrupt, error, match):
    state = corrupt(_good_state())
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12)
    with pytest.raises(error, match=match):
        plugin.load_state_dict(state)
    assert plugin.loss_scale == 2.0**12  # nothing half-loaded
    assert plugin.history.num_steps == 0


def test_a_0_1_0_state_still_loads():
    state = _good_state()
    nested = {
        "precision": "16-mixed",
        "history": state["history"],
        "scaler": {k: state[k] for k in state if k not in ("precision", "history")},
    }
    plugin = AmpPlusPrecision("16-mixed")
    plugin.load_state_dict(nested)
    assert plugin.loss_scale == 64.0
    assert plugin.history.num_steps == 2


def test_a_stock_state_under_bf16_is_said_and_our_own_state_says_nothing(caplog):
    stock = torch.amp.GradScaler("cpu", init_scale=512.0).state_dict()
    bf16 = AmpPlusPrecision("bf16-mixed")
    bf16.load_state_dict(stock)  # no "precision" key: a scaler state is a 16-mixed state
    assert "resuming a 16-mixed state under bf16-mixed: its loss scaler's state (scale 512.0) is dropped" in caplog.text
    caplog.clear()
    ours = AmpPlusPrecision("16-mixed", init_scale=64.0)
    ours.load_state_dict(AmpPlusPrecision("16-mixed", init_scale=64.0).state_dict())
    assert caplog.text == ""
