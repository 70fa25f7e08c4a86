import sys

import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpPlusPrecision
from lightning_amp_plus.islands import Fp32Islands
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


def test_an_island_hands_its_module_float32_floats_and_leaves_the_rest_as_they_came():
    """The dtype each argument arrives in inside an island: half floats float32; float64, ints, bools as given;
    through lists, tuples, named tuples and dicts, their types kept."""
    from collections import namedtuple

    from lightning_amp_plus.islands import Fp32Islands

    Pair = namedtuple("Pair", "a b")
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, items, pair, table):
            seen.update(
                x=x.dtype,
                items=[t.dtype for t in items],
                items_type=type(items),
                pair=(type(pair), pair.a.dtype, pair.b.dtype),
                table={k: v.dtype for k, v in table.items()},
                autocast=torch.is_autocast_enabled("cpu") if hasattr(torch, "get_autocast_dtype") else None,
            )
            return x

    model = nn.Module()
    model.probe = Probe()
    islands = Fp32Islands(["probe"])
    assert islands.install(model, "cpu") == ["probe"]
    half = torch.ones(2, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16):
        model.probe(
            half,
            (half, torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.long)),
            Pair(half, torch.ones(2, dtype=torch.bool)),
            {"h": half, "d": torch.ones(2, dtype=torch.float64)},
        )
    assert seen["x"] == torch.float32
    assert seen["items"] == [torch.float32, torch.float64, torch.int64]
    assert seen["items_type"] is tuple
    assert seen["pair"] == (Pair, torch.float32, torch.bool)
    assert seen["table"] == {"h": torch.float32, "d": torch.float64}
    assert seen["autocast"] in (False, None)


def test_an_unmatched_island_entry_names_the_closest_modules():
    from lightning_amp_plus.islands import Fp32Islands

    model = nn.Sequential()
    for i in range(1, 8):
        model.add_module(f"layer{i}", nn.Identity())

    def message(entry, on=model):
        with pytest.raises(ValueError, match="matches no module") as err:
            Fp32Islands([entry]).match(on)
        return str(err.value)

    assert message("layr") == (
        "`AmpPlusPrecision(fp32_modules=...)`: the pattern 'layr' matches no module of Sequential. Close module names:"
        " layer7, layer6, layer5, layer4, layer3."
    )
    assert message("ly").endswith("Close module names: layer7, layer6, layer5, layer4, layer3.")  # similarity 0.5
    assert message("zzzz").endswith("Close module names: layer1, layer2, layer3, layer4, layer5.")  # the first five
    assert message("qq", nn.Module()).endswith("matches no module of Module. Close module names: (none).")
    assert Fp32Islands(["*"]).match(model) == [f"layer{i}" for i in range(1, 8)]  # never the root itself


def test_removing_islands_restores_a_forward_the_user_set_on_the_instance():
    from lightning_amp_plus.islands import Fp32Islands

    model = nn.Sequential(nn.Linear(2, 2))
    mine = model[0].forward
    model[0].forward = lambda x: mine(x) * 2  # the user's own patch, on the instance
    patched = model[0].__dict__["forward"]
    islands = Fp32Islands(["0"])
    islands.install(model, "cpu")
    assert model[0].__dict__["forward"] is not patched
    islands.remove()
    assert model[0].__dict__["forward"] is patched
    plain = nn.Sequential(nn.Linear(2, 2))
    islands.install(plain, "cpu")
    islands.remove()
    assert "forward" not in plain[0].__dict__


def test_fp32_module_class_entries_resolve_only_to_module_classes():
    from lightning_amp_plus.islands import _resolve_class

    assert _resolve_class("torch.nn.LayerNorm") is nn.LayerNorm
    assert _resolve_class("collections.OrderedDict") is None  # a class, not a module class
    assert _resolve_class("torch.nn.functional.relu") is None
    assert _resolve_class("torch.nn.NoSuchLayer") is None
    assert _resolve_class("LayerNorm") is None
    assert _resolve_class("torch.nn.Layer*") is None
    assert _resolve_class("signal.proj") is None  # a module name whose first part is a stdlib module: a name


def test_a_module_name_with_pattern_characters_selects_that_module_as_printed():
    model = nn.Module()
    model.heads = nn.ModuleDict({"proj[0]": nn.Linear(4, 4), "proj0": nn.Linear(4, 4)})
    islands = Fp32Islands(["heads.proj[0]"])  # as the advisor prints a name: not the pattern matching `proj0`
    assert islands.install(model, "cpu") == ["heads.proj[0]"]
    with torch.autocast("cpu", dtype=torch.float16):
        x = torch.randn(2, 4)
        assert (model.heads["proj[0]"](x).dtype, model.heads["proj0"](x).dtype) == (torch.float32, torch.float16)
    islands.remove()
    assert Fp32Islands(["heads.proj?"]).match(model) == ["heads.proj0"]  # a pattern still selects by pattern


def test_a_module_name_never_imports_a_script_of_the_same_name(tmp_path, monkeypatch):
    """`fp32_modules=["towers.1.0"]` names a module of the model: a `towers.py` on the path is never run for it."""
    (tmp_path / "ampplus_towers.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["ampplus_towers.1.0", "ampplus_towers.head", "ampplus_towers.Proj"]  # a submodule named `Proj` too
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=names)
    assert plugin.fp32_modules == names
    assert not (tmp_path / "ran").exists()
    assert "ampplus_towers" not in sys.modules
