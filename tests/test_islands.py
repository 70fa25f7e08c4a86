import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpPlusPrecision
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Recorder(TinyModel):
    """Records the output dtype of every leaf module during training steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net.insert(1, nn.LayerNorm(16))  # net: 0 Linear, 1 LayerNorm, 2 ReLU, 3 Linear
        self.dtypes = {}

    def on_train_start(self):
        for name, module in self.named_modules():
            if name and not list(module.children()):
                module.register_forward_hook(lambda m, i, o, name=name: self.dtypes.__setitem__(name, o.dtype))


@pytest.mark.parametrize(
    ("entries", "fp32"),
    [
        (["net.3"], {"net.3"}),
        ([nn.Linear], {"net.0", "net.3"}),
        (["torch.nn.Linear"], {"net.0", "net.3"}),
        (["net.*"], {"net.0", "net.1", "net.2", "net.3"}),
    ],
)
def test_islands_run_in_float32_inside_a_fit(entries, fp32):
    model = Recorder()
    keys = set(model.state_dict())
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=entries)
    make_trainer(plugins=[plugin], max_steps=2).fit(model)
    for name in ("net.0", "net.3"):
        assert model.dtypes[name] == (torch.float32 if name in fp32 else torch.float16)
    assert set(model.state_dict()) == keys
    assert all("forward" not in vars(m) for m in model.modules())  # removed at teardown
    assert plugin.fp32_module_names == []


def test_checkpoint_with_islands_loads_without(tmp_path):
    model = Recorder()
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=["net.3"])
    trainer = make_trainer(plugins=[plugin], max_steps=2)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    fresh = Recorder()
    fresh.load_state_dict(torch.load(tmp_path / "c.ckpt", weights_only=False)["state_dict"])  # strict
    assert torch.equal(fresh.net[3].weight, model.net[3].weight)


def test_islands_are_visible_while_fitting():
    seen = {}

    class Probe(Recorder):
        def training_step(self, batch, batch_idx):
            seen["names"] = self.trainer.precision_plugin.fp32_module_names
            return super().training_step(batch, batch_idx)

    make_trainer(plugins=[AmpPlusPrecision("bf16-mixed", fp32_modules=["net.0"])], max_steps=1).fit(Probe())
    assert seen["names"] == ["net.0"]


def test_unmatched_pattern_is_refused_with_close_names():
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=["net.9", "nett.3"])
    with pytest.raises(ValueError, match=r"pattern 'net.9' matches no module of Recorder. Close module names: net.*"):
        make_trainer(plugins=[plugin], max_steps=1).fit(Recorder())


def test_unmatched_class_is_refused():
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=[nn.Conv2d])
    with pytest.raises(ValueError, match=r"class torch.nn.modules.conv.Conv2d matches no module"):
        make_trainer(plugins=[plugin], max_steps=1).fit(Recorder())


@pytest.mark.parametrize("bad", ["net.0", [3], [object]])
def test_bad_entries(bad):
    with pytest.raises(TypeError, match=r"`AmpPlusPrecision\(fp32_modules="):
        AmpPlusPrecision("16-mixed", fp32_modules=bad)
