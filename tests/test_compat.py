"""0.2's public names, kept one release with a DeprecationWarning naming their replacement, work as they did."""

import os

import pytest
import torch
from lightning.pytorch import Callback

import lightning_amp_plus
from lightning_amp_plus import AmpPlusFabricPrecision, AmpPlusPrecision, DynamicLossScaler, SkipEvent
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class _OldStyle(Callback):
    """A 0.2-style callback: it appends to the plugin's lists in `setup`, every fit."""

    def __init__(self):
        self.skips, self.unscales = [], []

    def setup(self, trainer, pl_module, stage):
        plugin = trainer.precision_plugin
        with pytest.deprecated_call(match=r"plugin.skip_listeners.*use plugin.listen\(listener\)"):
            plugin.skip_listeners.append(self.skips.append)
        with pytest.deprecated_call(match="plugin.before_unscale_listeners"):
            plugin.before_unscale_listeners.append(lambda optimizer, step: self.unscales.append(step))


def test_the_listener_lists_of_0_2_are_told_once_a_skip_and_cleared_at_teardown():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    old = _OldStyle()
    for fit in range(3):  # as in 0.2: the lists are the fit's, cleared at teardown, filled again in `setup`
        make_trainer(plugins=[plugin], callbacks=[old], max_steps=4).fit(TinyModel(poison={2: "inf"}))
        assert [type(e) for e in old.skips] == [SkipEvent] * (fit + 1)  # one event a skip, never piled up
        assert (old.skips[-1].step, old.skips[-1].new_scale) == (2, old.skips[-1].scale / 2)
        assert old.unscales == [0, 1, 2, 3] * (fit + 1)  # before each update's unscale
        with pytest.deprecated_call():
            assert plugin.skip_listeners == []


@pytest.mark.parametrize("make", [AmpPlusPrecision, AmpPlusFabricPrecision])
def test_sync_skips_of_0_2_sets_whether_a_fused_skip_is_read_at_its_step(make):
    plugin = make("16-mixed")
    with pytest.deprecated_call(match="plugin.sync_skips"):
        assert plugin.sync_skips is False
    with pytest.deprecated_call(match="needs_host_skips"):
        plugin.sync_skips = True
    assert plugin.engine.sync_skips is True
    with pytest.deprecated_call():
        plugin.sync_skips = False
    assert plugin.engine.sync_skips is False
    with pytest.deprecated_call():
        plugin.sync_skips = True
    if make is AmpPlusPrecision:  # as in 0.2, the Trainer plugin's teardown sets it back
        make_trainer(plugins=[plugin], max_steps=1).fit(TinyModel())
        assert plugin.engine.sync_skips is False


def test_the_scalers_step_queries_of_0_2():
    scaler = DynamicLossScaler("cpu", init_scale=4.0)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    assert scaler.has_stepped(optimizer) is False
    scaler.scale(param.sum()).backward()
    param.grad[0] = float("inf")
    scaler.step(optimizer)
    assert scaler.has_stepped(optimizer) is True
    with pytest.deprecated_call(match=r"any_skipped\(scaler.outcomes\(\), sync=True\)"):
        assert scaler.any_step_skipped() is True
    scaler.update()
    assert scaler.has_stepped(optimizer) is False  # a new cycle


def test_update_listener_is_importable_from_the_package():
    from lightning_amp_plus.engine import UpdateListener

    assert lightning_amp_plus.UpdateListener is UpdateListener


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("lightning_amp_plus.origins", "OriginFinder", "lightning_amp_plus.forensics.finder"),
        ("lightning_amp_plus.sandbox", "sandboxed", "lightning_amp_plus.forensics.opt_in.sandbox"),
        ("lightning_amp_plus.sandbox", "attempt", "lightning_amp_plus.forensics._safe"),
        ("lightning_amp_plus.forensics.sandbox", "sandboxed", "lightning_amp_plus.forensics.opt_in.sandbox"),
        ("lightning_amp_plus.forensics.sandbox", "attempt", "lightning_amp_plus.forensics._safe"),
        ("lightning_amp_plus.forensics.sandbox", "torch_own", "lightning_amp_plus.forensics._safe"),
    ],
)
def test_the_0_3_forensics_paths_warn_at_your_line_and_give_the_same_object(old, name, new):
    import importlib

    with pytest.warns(DeprecationWarning, match=rf"`{old}.{name}` moved to `{new}.{name}`") as caught:
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)
    if not os.environ.get("MUTANT_UNDER_TEST"):  # mutmut's trampolines add a frame of their own
        assert caught[0].filename == __file__  # the user's line, not ours
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        importlib.import_module(old).nothing  # noqa: B018


@pytest.mark.parametrize("name", ["MAX_ISLANDS", "value_at", "Origin", "_nice", "_scaling_skips"])
def test_a_name_0_4s_advice_module_held_warns_and_is_given_from_its_family(name):
    from lightning_amp_plus import advice

    with pytest.warns(DeprecationWarning, match=rf"`lightning_amp_plus.advice.{name}` moved to `lightning_amp_plus"):
        found = getattr(advice, name)
    assert found is not None
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        advice.nothing  # noqa: B018
