"""0.2's public names, kept one release with a DeprecationWarning naming their replacement, work as they did."""

import pytest
import torch

import lightning_amp_plus
from lightning_amp_plus import AmpPlusFabricPrecision, AmpPlusPrecision, DynamicLossScaler, SkipEvent
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


def test_the_listener_lists_of_0_2_are_told_and_kept_across_fits():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    skips, unscales = [], []
    with pytest.deprecated_call(match=r"plugin.skip_listeners.*use plugin.listen\(listener\)"):
        plugin.skip_listeners.append(skips.append)
    with pytest.deprecated_call(match="plugin.before_unscale_listeners"):
        plugin.before_unscale_listeners.append(lambda optimizer, step: unscales.append(step))
    for fit in range(2):  # the plugin kept 0.2's lists across fits: the second fit tells them too
        make_trainer(plugins=[plugin], max_steps=4).fit(TinyModel(poison={2: "inf"}))
        assert [type(e) for e in skips] == [SkipEvent] * (fit + 1)
        assert (skips[-1].step, skips[-1].new_scale) == (2, skips[-1].scale / 2)
        assert unscales[-4:] == [0, 1, 2, 3]  # before each update's unscale


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
