"""OriginFinder: watched by default (nothing runs again), measured by replay when asked for by name.

The watch names where inf/nan were born; the opt-in replay measures the float32 verdict and the islands; a fix
printed from either, pasted as printed, is measured to help, and a chain of fixes ends in the one that works.
"""

import functools
import math
import random

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.forensics._modules import call_frontier
from lightning_amp_plus.forensics.finder import OriginFinder
from lightning_amp_plus.forensics.observe import BatchRecord
from lightning_amp_plus.forensics.opt_in.sandbox import sandboxed
from lightning_amp_plus.forensics.origin import IN_ISLAND, WATCHING, Origin, Phase, Verdict
from tests.helpers.models import SentinelRouter, TinyModel
from tests.helpers.trainer import make_trainer, watched_fit


class Tracker(nn.Module):
    """Updates its running mean by assignment (a common idiom) and counts its calls in a plain attribute."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.calls = 0
        self.last = torch.zeros(8)  # a tensor held as a plain attribute, changed in place

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.detach().float().mean(0)
        self.calls += 1
        self.last.add_(1.0)
        return x - self.mean


class Tracking(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(poison={s: "nan" for s in range(3, 22, 2)}, **kwargs)
        self.tracker = Tracker()

    def forward(self, x):
        return self.net(self.tracker(x))


def _fit(callbacks):
    torch.manual_seed(0)
    model = Tracking()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**16)
    make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=24).fit(model)
    return model, plugin


@pytest.mark.parametrize("diagnostic", ["reporter", "advisor"])
def test_the_watch_leaves_the_model_exactly_as_it_found_it(diagnostic):
    plain, plain_plugin = _fit([NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False)])
    callback = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0) if diagnostic == "reporter" else AmpAdvisor()
    told, told_plugin = _fit([callback])
    assert told_plugin.history.num_skipped == plain_plugin.history.num_skipped == 10
    for (name, a), (_, b) in zip(plain.state_dict().items(), told.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # weights and the assigned buffer, bit for bit
    assert told.tracker.calls == plain.tracker.calls
    assert torch.equal(told.tracker.last, plain.tracker.last)
    reporter = callback if diagnostic == "reporter" else callback._reporter
    origins = [r["origin"] for r in reporter.skips]
    assert origins[0] == {"phase": "forward", "kind": "nan", "reason": WATCHING}  # read from the loss: it watches
    assert origins[1:] == [{"phase": "loss"}] * 9  # watched: every module's output finite, the loss not


def test_a_replay_that_writes_a_parameter_in_place_writes_its_stand_in():
    class Writer(nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.mul_(2.0)
                self.bias.data = self.bias.data + 1.0  # a `.data` write: no version counter moves
            return super().forward(x)

    module = nn.Sequential(Writer(2, 2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    weight = module[0].weight
    with sandboxed([module], "cpu"):
        module(torch.ones(1, 2))
        assert module[0].weight is not weight  # a stand-in, written
    assert module[0].weight is weight
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


class Stack(TinyModel):
    """Its layers sit in an `nn.ModuleList`, which is never called itself; `layers.1` overflows float16."""

    def __init__(self, **kwargs):
        super().__init__(optimizer="fused_sgd", **kwargs)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)])
        with torch.no_grad():
            self.layers[1].weight.mul_(1e6)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.net(x)


def test_call_frontier_descends_into_containers():
    assert [n for n, _ in call_frontier(Stack())] == ["net", "layers.0", "layers.1", "layers.2"]


def _advised(model, max_steps=8, reporter=None, **plugin):
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", **{"init_scale": 1024.0, **plugin})
    make_trainer(plugins=[plugin], callbacks=[*([reporter] if reporter else []), advisor], max_steps=max_steps).fit(
        model
    )
    return advisor, plugin


def _pasted(fix):
    return eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})


@pytest.mark.parametrize("find_origin", [True, "replay"])
def test_an_overflow_born_inside_a_module_list_is_named_and_its_island_fixes_it(find_origin):
    advisor, plugin = _advised(Stack(), reporter=NaNSkipReporter(find_origin=find_origin, max_consecutive_skips=None))
    assert plugin.history.num_skipped == 8
    origins = [r["origin"] for r in advisor._reporter.skips]
    if find_origin is True:  # watched: named from the second skip on, nothing measured
        assert origins[0]["reason"] == WATCHING
        assert origins[1:] == [{"phase": "forward", "module": "layers.1", "kind": "nan"}] * 7  # inf - inf there
    else:  # watched from the start, and measured by replay: with it in float32 the call's output is finite
        assert (
            origins
            == [{"phase": "forward", "module": "layers.1", "kind": "nan", "float32": "finite", "islands": ["layers.1"]}]
            * 8
        )
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["layers.1"])'
    assert advice.evidence["measured"] is (find_origin == "replay")
    assert ('find_origin="replay")' in advice.message) is (find_origin is True)  # the opt-in that measures it
    assert "model_nonfinite" not in [a.code for a in advisor.advice]
    fixed = _pasted(advice.fix)
    make_trainer(plugins=[fixed], max_steps=8).fit(Stack())
    assert fixed.history.num_skipped == 0


class Padded(TinyModel):
    """Attention over a batch whose row 0 is all padding: NaN in float32 too (unless one key stays unmasked)."""

    def __init__(self, unmask_one=False, **kwargs):
        super().__init__(**kwargs)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.unmask_one = unmask_one

    def forward(self, x):
        seq = x.reshape(x.shape[0], 1, 8).expand(-1, 3, -1)
        padding = torch.zeros(x.shape[0], 3, dtype=torch.bool)
        padding[0] = True
        if self.unmask_one:
            padding[0, 0] = False
        out, _ = self.attn(seq, seq, seq, key_padding_mask=padding)  # need_weights=True, the default
        return self.net(out.mean(1))


def test_the_advice_chain_for_nan_the_model_makes_in_any_precision_ends_in_the_code_fix():
    """Watched, the first fix is the island the observation supports; run as an island the module still makes NaN,
    which the watch then reads as float32's own; the code fix that advice gives ends the skips."""
    first, plugin = _advised(Padded(), max_steps=6)
    assert plugin.history.num_skipped == 6
    assert [a.code for a in first.advice][0] == "fp32_module"
    island = _pasted(first.advice[0].fix)
    assert island.fp32_modules == ["attn"]
    second, plugin = _advised(Padded(), max_steps=6, fp32_modules=["attn"])
    assert plugin.history.num_skipped == 6  # measured: the island does not help
    assert second._reporter.skips[1]["origin"] == {
        "phase": "forward",
        "module": "attn",
        "kind": "nan",
        "float32": "nonfinite",
        "reason": IN_ISLAND,
    }
    codes = [a.code for a in second.advice]
    assert codes[0] == "model_nonfinite"
    assert "fp32_module" not in codes
    assert "bf16" not in codes
    assert "one unmasked key" in second.advice[0].fix
    fixed = AmpPlusPrecision("16-mixed", init_scale=1024.0)  # what the fix says: one unmasked key per row
    make_trainer(plugins=[fixed], max_steps=6).fit(Padded(unmask_one=True))
    assert fixed.history.num_skipped == 0


def test_the_replay_tells_nan_in_any_precision_in_one_run():
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None)
    advisor, _ = _advised(Padded(), max_steps=6, reporter=replayed)
    assert replayed.skips[0]["origin"] == {"phase": "forward", "module": "attn", "kind": "nan", "float32": "nonfinite"}
    assert [a.code for a in advisor.advice][0] == "model_nonfinite"


def test_the_collapse_error_says_what_the_advisor_says():
    advisor = AmpAdvisor(print_advice=False)
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    with pytest.raises(LossScaleCollapseError) as error:
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter, advisor], max_steps=10
        ).fit(Padded())
    first = advisor.advice[0]
    assert first.code == "fp32_module"  # watched: the island the observation supports, and what measures it
    assert f"{first.message} HINT: {first.fix}" in str(error.value)
    assert "precision='bf16-mixed'" not in str(error.value)  # no scaling hint beside it


def test_before_the_watch_the_batch_and_the_loss_tell_the_phase():
    finder = OriginFinder()
    assert finder.origin() is None
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)

    def told(batch, loss):
        return finder.origin(BatchRecord(batch, losses=[loss]))

    assert told(torch.ones(2), nan) == Origin(Phase.FORWARD, kind="nan", reason=WATCHING)
    assert told(torch.tensor([float("inf")]), nan) == Origin(Phase.INPUT, reason=WATCHING)
    assert told(torch.tensor([float("inf")]), one) == Origin(Phase.BACKWARD, batch_too=True)  # no watch for it
    assert told(torch.ones(2), one) == Origin(Phase.BACKWARD)  # a finite loss and batch: the watch stays off
    mask = torch.tensor([0.0, float("-inf")])  # an additive mask is no bad data
    assert told(mask, one) == Origin(Phase.BACKWARD)
    finder.start_batch(torch.ones(2))
    assert finder.origin() == Origin(Phase.BACKWARD)
    assert finder.take_batch() is not None
    assert finder.current is None


class Augment(nn.Module):
    """Draws from Python's and numpy's random state and keeps counts in a defaultdict, a dict of lists and a deque."""

    def __init__(self):
        super().__init__()
        import collections

        self.calls = collections.defaultdict(int)
        self.history = {"seen": []}
        self.recent = collections.deque(maxlen=3)
        self.tags = set()

    def forward(self, x):
        import random

        import numpy as np

        self.calls["n"] += 1
        self.history["seen"].append(1)
        self.recent.append(self.calls["n"])
        self.tags.add(self.calls["n"])
        return x * (0.5 + random.random()) * float(1.0 + np.random.rand())


class Augmented(TinyModel):
    def __init__(self):
        super().__init__(poison={3: "nan", 6: "nan"})
        self.augment = Augment()

    def forward(self, x):
        return self.net(self.augment(x))


def _fit_augmented(callbacks):
    import random

    import numpy as np

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Augmented()
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=callbacks, max_steps=10).fit(model)
    return model


def test_the_float32_reference_gives_back_every_random_stream_and_runs_the_rest_again():
    """Its contract, as the docs say it: parameters, buffers and random streams put back; the rest happens again."""
    import random

    import numpy as np

    from lightning_amp_plus import GradUnderflowMonitor

    def run(callbacks):
        model = _fit_augmented(callbacks)
        return model, (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    (base, base_rng) = run([NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False)])
    (told, told_rng) = run(
        [
            NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False),
            GradUnderflowMonitor(every_n_steps=1, exact=True),
        ]
    )
    for (name, a), (_, b) in zip(base.state_dict().items(), told.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(base_rng[0], told_rng[0])
    assert base_rng[1] == told_rng[1]
    assert np.array_equal(base_rng[2], told_rng[2])
    assert base.augment.calls == {"n": 10}
    assert told.augment.calls["n"] > 10  # the step's forward ran again: its own counts show it, as documented


class _StepSideEffects(TinyModel):
    """A training step that writes weights in place (an EMA, a clamp), hooks an activation and takes a gradient
    penalty: code the origin replay must never run again. Its own noise comes from a module-held generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ema = torch.nn.Linear(8, 16)
        self.gen = torch.Generator().manual_seed(0)
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = (x + 0.01 * torch.randn(x.shape, generator=self.gen)).requires_grad_(True)
        self.steps_seen += 1
        with torch.no_grad():
            self.ema.weight.mul_(0.9).add_(0.1 * self.net[0].weight)  # an in-place parameter write
        h = self.net[0](x)
        h.register_hook(lambda g: g)  # needs grad
        (penalty,) = torch.autograd.grad(h.float().sum(), x, create_graph=True)  # needs grad
        loss = torch.nn.functional.mse_loss(self.net[2](torch.relu(h)).float(), y) + 1e-6 * penalty.pow(2).mean()
        kind = self.poison.get(self.trainer.global_step)
        return loss * float(kind) if kind is not None else loss


def test_the_watch_never_runs_the_training_steps_own_code():
    def run(find_origin):
        torch.manual_seed(0)
        model = _StepSideEffects(poison={2: "inf", 4: "nan"})
        reporter = NaNSkipReporter(max_consecutive_skips=None, find_origin=find_origin)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=6).fit(model)
        return model, reporter

    model, reporter = run(True)
    assert [r["origin"] for r in reporter.skips] == [
        {"phase": "forward", "kind": "inf", "reason": WATCHING},  # the loss alone read: it watches from then on
        {"phase": "loss"},  # watched: every module's output finite
    ]
    assert model.steps_seen == 6  # the step's code ran once a batch, skipped batches included
    plain, _ = run(False)
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the EMA written once, the module's generator as it was: bit-identical
    assert torch.equal(model.gen.get_state(), plain.gen.get_state())


class _Noise(nn.Module):
    """Adds noise from a generator it holds (a replayed module draws from it again)."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x + 0.01 * torch.randn(x.shape, generator=self.gen)


class _OwnNoise(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = _Noise()

    def forward(self, x):
        return self.net(self.noise(x))


def test_a_replay_gives_back_a_modules_own_random_stream():
    def run(find_origin):
        torch.manual_seed(0)
        model = _OwnNoise(poison={2: "inf"})
        reporter = NaNSkipReporter(find_origin=find_origin)
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=5).fit(
            model
        )
        return model

    replayed, plain = run(True), run(False)
    assert torch.equal(replayed.noise.gen.get_state(), plain.noise.gen.get_state())
    assert all(torch.equal(a, b) for a, b in zip(replayed.parameters(), plain.parameters(), strict=True))


class _Clamped(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-10.0, 10.0)  # writes its own parameter in place, every call
        return super().forward(x)


class _ClampsInForward(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net[0] = _Clamped(8, 16)


class _EmaInStep(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ema = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.ema.weight.mul_(0.9).add_(0.1 * self.net[0].weight)
        return super().training_step(batch, batch_idx)


def _loud_loader(steps=(1, 3), n=32):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    for step in steps:
        x[step * 4 : step * 4 + 4] *= 1e5  # beyond float16: the first layer's input cast overflows
    return DataLoader(TensorDataset(x, torch.zeros(n, 1)), batch_size=4)


def test_replays_that_write_parameters_leave_the_run_bit_identical(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_amp_plus import GradUnderflowMonitor

    def clamped(find_origin):
        torch.manual_seed(0)
        model = _ClampsInForward()
        reporter = NaNSkipReporter(find_origin=find_origin, max_consecutive_skips=None)
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter], max_steps=6).fit(
            model, _loud_loader()
        )
        return model, reporter

    (told, reporter), (plain, _) = clamped("replay"), clamped(False)
    assert [r["origin"].get("float32") for r in reporter.skips] == ["finite", "finite"]  # the module ran again
    for (name, a), (_, b) in zip(told.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # its clamp wrote the stand-in

    def ema(callbacks):
        torch.manual_seed(0)
        model = _EmaInStep()
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed")], callbacks=callbacks, logger=CSVLogger(tmp_path), max_steps=4
        ).fit(model)
        return model

    monitor = GradUnderflowMonitor(every_n_steps=1, exact=True)
    referenced, unreferenced = ema([monitor]), ema([])
    assert [m["reference"] for m in monitor.measurements] == ["float32"] * 4  # the step ran again, 4 times
    for (name, a), (_, b) in zip(referenced.state_dict().items(), unreferenced.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the EMA written once a step: the reruns wrote stand-ins


class _DropThenLoud(TinyModel):
    """Dropout inside the module whose layer overflows only where the dropout mask keeps a large input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 8))
        with torch.no_grad():
            self.body[1].weight.fill_(0.0)
            self.body[1].weight[:, 0] = 1e3  # input feature 0, when kept (x2 by dropout), overflows float16

    def forward(self, x):
        return self.net(self.body(x))


@pytest.mark.parametrize("find_origin", [True, "replay"])
def test_dropout_before_an_overflow_is_read_as_the_step_drew_it(find_origin):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    x[:, 0] = 40.0  # 40 * 2 * 1e3 = 8e4 > 65504 where kept
    loader = DataLoader(TensorDataset(x, torch.zeros(64, 1)), batch_size=1)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=24).fit(_DropThenLoud(lr=0.0), loader)
    assert 4 <= plugin.history.num_skipped <= 20  # the mask decided: some batches overflowed, some did not
    named = [r["origin"] for r in reporter.skips if "module" in r["origin"]]
    assert len(named) >= len(reporter.skips) - 1  # all but a first one read before the watch
    for origin in named:  # watched as the step ran; replayed from the random state the call started from
        assert origin["module"] == "body.1", origin
        assert origin.get("float32", "finite") == "finite", origin


class _OwnLayerDrop(nn.Module):
    """LayerDrop from its own `random.Random`: which layers run is drawn in its forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.rng = random.Random(0)
        with torch.no_grad():
            self.layers[1].weight.mul_(1e6)  # overflows float16 whenever it runs

    def forward(self, x):
        for layer in self.layers:
            if self.rng.random() < 0.5:
                continue
            x = layer(x)
        return x


class _LayerDropped(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = _OwnLayerDrop()

    def forward(self, x):
        return self.net(self.drop(x))


@pytest.mark.parametrize("find_origin", [True, "replay"])
def test_a_module_drawing_from_its_own_stream_is_named_right_and_its_stream_given_back(find_origin):
    def run(find_origin):
        torch.manual_seed(0)
        model = _LayerDropped(lr=0.0)
        reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=16).fit(model)
        return model, reporter

    told, reporter = run(find_origin)
    plain, _ = run(False)
    assert told.drop.rng.getstate() == plain.drop.rng.getstate()  # watched: untouched; replayed: given back
    named = [r["origin"] for r in reporter.skips if "module" in r["origin"]]
    assert named
    assert len(named) >= len(reporter.skips) - 1
    for origin in named:  # the layer that ran and overflowed, as the step drew it
        assert origin["module"] == "drop.layers.1", origin


class _ParentMakesIt(nn.Module):
    """Its own code (not a child) multiplies by 1e6 and hands the result to its child."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(x.half() * 1e6)


class _Parented(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.outer = _ParentMakesIt()

    def forward(self, x):
        return self.net(self.outer(x))


def test_a_child_fed_inf_by_its_parents_own_code_is_not_blamed():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter], max_steps=3).fit(_Parented())
    assert len(reporter.skips) == 3
    for record in reporter.skips[1:]:
        assert record["origin"]["module"] == "outer", record["origin"]  # made in its forward, fed to `outer.inner`


class _TakesCache(TinyModel):
    """The LightningModule makes a cache and hands it to a child that appends to it (a stateful argument)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attn = _CachedLoud()

    def forward(self, x):
        cache = []
        return self.net(self.attn(x, cache))


class _CachedLoud(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(1e5)

    def forward(self, x, cache):
        cache.append(x)
        if len(cache) != 1:
            raise RuntimeError(f"The size of tensor a ({len(cache)}) must match the size of tensor b (1)")
        return self.proj(torch.stack(cache).sum(0))


def test_a_replay_never_raises_into_training_and_never_changes_a_cache_it_was_handed():
    def run(find_origin):
        torch.manual_seed(0)
        model = _TakesCache(lr=0.0)
        reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=3).fit(model)
        return model, reporter

    told, reporter = run("replay")
    plain, _ = run(False)
    assert len(reporter.skips) == 3  # the fit ran to its end
    for record in reporter.skips:
        # the step appended to the cache it handed over: a replay from it would not be the step's call
        assert record["origin"] == {
            "phase": "forward",
            "module": "attn.proj",  # watched: named all the same
            "kind": "inf",
            "reason": "not measured: the step changed the inputs of attn in place after the call",
        }
    for (name, a), (_, b) in zip(told.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


class _Armed(nn.Module):
    """Raises unless the step armed it for this call: a replay of it raises."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.armed = False
        with torch.no_grad():
            self.proj.weight.mul_(1e5)

    def forward(self, x):
        if not self.armed:
            raise RuntimeError("called twice in one step")
        self.armed = False
        return self.proj(x)


class _ArmedModel(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attn = _Armed()

    def forward(self, x):
        self.attn.armed = True
        return self.net(self.attn(x))


def test_a_replay_that_raises_is_told_never_raised():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin="replay")
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter], max_steps=3).fit(_ArmedModel(lr=0.0))
    assert [r["origin"] for r in reporter.skips] == [
        {
            "phase": "forward",
            "module": "attn.proj",
            "kind": "inf",
            "float32": "unknown",
            "reason": "the replay of attn raised RuntimeError: called twice in one step",
        }
    ] * 3


# ----------------------------------------------------------------------- rules kept, each with a test that kills it
def _told(model, batch, step):
    """One step of ``step(model, batch)`` under float16 autocast, recorded; the finder's origin of it."""
    finder = OriginFinder(replay=True)

    def autocast():
        return torch.autocast("cpu", dtype=torch.float16)

    finder.attach(model, autocast)
    try:
        finder.start_batch(batch)
        with autocast():
            loss = step(model, batch)
        finder.current.losses.append(loss)
        return finder.origin()
    finally:
        finder.detach()


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 1)


def test_the_batch_is_named_only_for_a_kind_of_inf_nan_it_holds():
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))
    x[0, 0, 7] = float("nan")  # the batch holds NaN at sample 0, which the step fills in

    def overflowing(model, x):  # the own code's float16 product overflows to inf: a kind the batch does not hold
        return model.head(x.nan_to_num(nan=0.0).reshape(12, 8).half() * 1e5).float().sum()

    told = _told(_Head(), x, overflowing)
    assert (told.phase, told.own_code, told.kind) == (Phase.FORWARD, True, "inf")  # its own code's, not the batch's

    def flattened(model, x):  # a view of the batch: its NaN reach the module
        return model.head(x.view(12, 8)).float().sum()

    assert _told(_Head(), x, flattened) == Origin(Phase.INPUT)


def _tiny(net):
    """A TinyModel that trains nothing (lr 0) around ``net``: each step overflows the same way."""
    model = TinyModel(optimizer="fused_sgd", lr=0.0)
    model.net = net
    return model


class _CarriedOn(nn.Module):
    """``a`` overflows float16 (1e5); the own code carries its float32 value on to ``b`` (a new tensor, not ``a``'s
    output), where autocast casts it back: an island on ``a`` alone changes nothing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        with torch.no_grad():
            self.a.weight.zero_()
            self.a.bias.fill_(1e5)
            self.b.weight.fill_(1e-5)

    def forward(self, x):
        return self.b(self.a(x) * 1.0)


def test_no_islands_are_claimed_where_the_own_code_carries_the_float32_value_on():
    told = _told(_CarriedOn(), torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert (told.phase, told.module, told.float32.value) == (Phase.FORWARD, "a", "finite")
    assert told.islands == ()  # an fp16 overflow no island shown to contain: none claimed
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["net.a"])
    make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_CarriedOn()))
    assert plugin.history.num_skipped == 4  # measured: the island the rule refuses would not have helped


class _Tower(nn.Module):
    """Its linear layer overflows float16 (8e4 or more); its own code scales that into float16's range (8 and up)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        with torch.no_grad():
            self.lin.weight.fill_(1e4)
            self.lin.bias.zero_()

    def forward(self, x):
        return self.lin(x.abs() + 1.0) * 1e-4


class _NaNs(nn.Module):
    def forward(self, x):
        return torch.log(-(x.abs() + 1.0)).sum(1, keepdim=True)  # NaN in any precision


class _Towers(nn.Module):
    """``a`` and ``other`` each make inf/nan from the batch on their own."""

    def __init__(self, other):
        super().__init__()
        self.a, self.other = _Tower(), other

    def forward(self, x):
        return self.a(x) + self.other(x)


def test_islands_cover_every_later_call_that_overflows_on_its_own():
    told = _told(_Towers(_Tower()), torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert (told.module, told.kind, told.float32.value) == ("a.lin", "inf", "finite")
    assert told.islands == ("a.lin", "other.lin")  # the second tower's overflow too: one island would not do
    runs = {}
    for islands in (["net.a.lin"], ["net.a.lin", "net.other.lin"]):
        plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, fp32_modules=islands)
        make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_Towers(_Tower())))
        runs[len(islands)] = plugin.history.num_skipped
    assert runs == {1: 4, 2: 0}  # measured: the first island alone skips every step, both end the skips


def test_no_islands_are_claimed_beside_a_later_call_that_makes_nan_in_any_precision():
    told = _told(_Towers(_NaNs()), torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert told == Origin(Phase.FORWARD, "a.lin", "inf", Verdict.FINITE, islands=())


class _Counting(nn.Module):
    """Scales its output by how often it was called: a replay computes other values than the step did."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.calls = 0
        with torch.no_grad():
            self.lin.weight[0].fill_(1e5)  # the first output overflows float16, the second stays finite

    def forward(self, x):
        self.calls += 1
        return self.lin(x.abs()) * self.calls


def test_a_replay_that_computes_other_values_measures_nothing():
    model, kept = nn.Module(), []
    model.counting = _Counting()

    def step(model, x):
        kept.append(model.counting(x))  # held past the step: the replay is compared with it
        return kept[-1].float().sum()

    told = _told(model, torch.randn(4, 8), step)
    assert (told.phase, told.module, told.kind, told.float32) == (Phase.FORWARD, "counting.lin", "inf", None)
    assert told.reason == "not measured: the replay of counting computed other values than the step"


class _Fed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, h, extra):
        return self.lin(h) + self.lin(extra)


class _FedOn(nn.Module):
    """``b`` takes ``a``'s output and the own code's ``a(x) * 1e5``, which overflows float16 in ``b`` whatever ``a``
    runs in: an island on ``a`` cannot be shown to fix ``b``'s output (the replay does not rerun the own code)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Tower(), _Fed()

    def forward(self, x):
        h = self.a(x)
        return self.b(h, h * 1e5)


def test_no_islands_are_claimed_where_a_later_call_of_the_chain_stays_non_finite():
    told = _told(_FedOn(), torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert (told.module, told.float32.value, told.islands) == ("a.lin", "finite", ())
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, fp32_modules=["net.a.lin"])
    make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_FedOn()))
    assert plugin.history.num_skipped == 4  # measured: the island the replay could not show to help does not


class _Amplified(nn.Module):
    """``a``'s float32 output fits float16 (8 and up), but the own code scales it by 1e4 for ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Tower(), nn.Linear(1, 1)

    def forward(self, x):
        return self.b(self.a(x) * 1e4)


def test_no_islands_are_claimed_where_the_own_code_feeds_a_later_call():
    told = _told(_Amplified(), torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert (told.module, told.float32.value, told.islands) == ("a.lin", "finite", ())
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, fp32_modules=["net.a.lin"])
    make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_Amplified()))
    assert plugin.history.num_skipped == 4  # measured: the island alone does not help (b overflows instead)


class _Exp(nn.Module):
    def forward(self, h):
        return torch.exp(h * 1e-3).sum(-1, keepdim=True)  # exp(80) and more: inf in float32 too


class _ExpAfter(nn.Module):
    """``a`` overflows float16 (finite in float32, 8e4 and up); ``b`` takes its output and overflows float32."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), _Exp()
        with torch.no_grad():
            self.a.weight.fill_(1e4)
            self.a.bias.zero_()

    def forward(self, x):
        return self.b(self.a(x.abs() + 1.0))


def test_where_the_float32_value_flows_into_inf_in_float32_too_that_module_is_the_origin():
    model, x = _ExpAfter(), torch.randn(4, 8)
    assert not torch.isfinite(model(x)).all()  # independently: the model in float32 makes inf
    told = _told(model, x, lambda model, x: model(x).float().sum())
    assert told == Origin(Phase.FORWARD, "b", "inf", Verdict.NONFINITE)  # no precision avoids it: not bf16's


class _StdNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class _Rounded(nn.Module):
    """``enc`` gives 10 +- 1e-3, which float16 rounds to 10 everywhere: ``norm`` then divides 0 by 0."""

    def __init__(self):
        super().__init__()
        self.enc, self.norm, self.head = nn.Linear(8, 16), _StdNorm(), nn.Linear(16, 1)
        with torch.no_grad():
            self.enc.weight.mul_(1e-3)
            self.enc.bias.fill_(10.0)

    def forward(self, x):
        return self.head(self.norm(self.enc(x)))


def test_nan_from_a_rounding_upstream_is_no_model_nan_and_its_islands_fix_it():
    model, x = _Rounded(), torch.randn(4, 8)
    assert torch.isfinite(model(x)).all()  # independently: finite in float32
    told = _told(model, x, lambda model, x: model(x).float().sum())
    assert (told.module, told.kind, told.float32) == ("norm", "nan", Verdict.FINITE)  # not "in any precision"
    assert told.islands == ("norm", "enc")  # the call that fed it, in float32 too
    runs = {}
    for islands in (["net.norm"], ["net.norm", "net.enc"]):
        plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, fp32_modules=islands)
        make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_Rounded()))
        runs[len(islands)] = plugin.history.num_skipped
    assert runs == {1: 4, 2: 0}  # measured: norm alone does not help, with enc it ends the skips
    advisor = AmpAdvisor(print_advice=False)  # one call holding both: the call in float32 is the island
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)],
        callbacks=[replayed, advisor],
        max_steps=4,
    ).fit(_tiny(_Rounded()))
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert "model_nonfinite" not in [a.code for a in advisor.advice]
    fixed = eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})  # pasted as printed
    make_trainer(plugins=[fixed], max_steps=4).fit(_tiny(_Rounded()))
    assert fixed.history.num_skipped == 0


class _NormBy(nn.Module):
    def forward(self, h, mu):
        return (h - mu) / (h - mu).abs().amax(-1, keepdim=True)


class _DeadNorm(nn.Module):
    """``enc`` is dead (every row constant): ``norm`` divides 0 by 0 in float32 too, by the own code's mean."""

    def __init__(self):
        super().__init__()
        self.enc, self.norm = nn.Linear(8, 16), _NormBy()
        with torch.no_grad():
            self.enc.weight.zero_()
            self.enc.bias.fill_(1 + 2**-12)  # exact in float32, rounded to 1 in float16

    def forward(self, x):
        h = self.enc(x)
        return self.norm(h, h.mean(-1, keepdim=True))


def test_a_nan_in_any_precision_fed_by_the_own_code_is_not_read_as_a_rounding():
    model, x = _DeadNorm(), torch.randn(4, 8)
    assert not torch.isfinite(model(x)).all()  # independently: NaN in float32 too
    told = _told(model, x, lambda model, x: model(x).float().sum())
    assert (told.module, told.kind, told.float32) == (
        "norm",
        "nan",
        Verdict.NONFINITE,
    )  # the own code's mean: no replay


def _hooked(module):
    """``module`` with its forward wrapped on the instance, as accelerate's ``add_hook_to_module`` does."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return original(*args, **kwargs)

    module.forward = forward
    return module


class _HookedTower(_Tower):
    """``lin`` overflows float16 (8e4 and up) and carries a library's forward on its instance."""

    def __init__(self):
        super().__init__()
        _hooked(self.lin)


def test_a_module_whose_forward_a_library_set_on_its_instance_is_measured_in_float32():
    model = _HookedTower()
    hook = vars(model.lin)["forward"]
    told = _told(model, torch.randn(4, 8), lambda model, x: model(x).float().sum())
    assert (told.module, told.kind, told.float32, told.islands) == ("lin", "inf", Verdict.FINITE, ("lin",))
    assert vars(model.lin)["forward"] is hook  # the library's forward, as the replay found it
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, fp32_modules=["net.lin"])
    make_trainer(plugins=[plugin], max_steps=4).fit(_tiny(_HookedTower()))
    assert plugin.history.num_skipped == 0  # measured: the island the replay claims ends the skips


class _ThreeTowers(LightningModule):
    """Three towers of two Linears. Tower k's first overflows float16 (8e4) on the batches whose slice k is loud, and
    its float32 output overflows the second in turn. Each module makes a minority of the skips (issue 52)."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)) for _ in range(3))
        with torch.no_grad():
            for tower in self.towers:
                tower[0].weight.fill_(1e3)
                tower[0].bias.zero_()
                tower[2].weight.fill_(1e-4)
                tower[2].bias.zero_()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return sum(t(x[:, 8 * k : 8 * k + 8]).float().mean() for k, t in enumerate(self.towers)) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _three_towers_fit(plugin, callbacks=()):
    x = torch.rand(24, 4, 24, generator=torch.Generator().manual_seed(0))
    for i in range(1, 24, 4):  # 6 of 24 batches (25%), each tower loud on 2 of them
        k = (i // 4) % 3
        x[i, :, 8 * k : 8 * k + 8] = 10.0
    torch.manual_seed(0)
    make_trainer(plugins=[plugin], callbacks=list(callbacks), max_steps=24).fit(
        _ThreeTowers(), DataLoader(TensorDataset(x.reshape(96, 24)), batch_size=4)
    )
    return plugin


def test_three_towers_each_a_minority_get_the_union_and_the_second_run_prints_the_fix_that_trains():
    """Run 1 names the three first Linears (the union: none makes most skips); run 2, with them, names the three
    second Linears their float32 outputs overflow, beside the given islands (six: not a chain too long for float16);
    the fix it prints, pasted, trains with no forward-born skip."""
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    fixes = []
    for _ in range(3):
        advisor = AmpAdvisor(print_advice=False)
        plugin = _three_towers_fit(plugin, [advisor])
        if not advisor.advice or advisor.advice[0].code != "fp32_module":
            break
        assert "auto_islands=True" in advisor.advice[0].message  # the way to the islands in one run
        fixes.append(advisor.advice[0].fix)
        plugin = eval(fixes[-1], {"AmpPlusPrecision": AmpPlusPrecision})
    firsts = ", ".join(f'"towers.{k}.0"' for k in (1, 2, 0))  # the most frequent first
    seconds = ", ".join(f'"towers.{k}.2"' for k in (1, 2, 0))
    assert fixes == [
        f'AmpPlusPrecision("16-mixed", init_scale=2.0**0, min_scale=0.0, fp32_modules=[{firsts}])',
        f'AmpPlusPrecision("16-mixed", init_scale=2.0**0, min_scale=0.0, fp32_modules=[{firsts}, {seconds}])',
    ]
    assert plugin.history.skipped_steps == []  # the pasted fix trains: no skip at all
    _three_towers_fit(plain := AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0))
    assert plain.history.skipped_steps == [0, 1, 5, 9, 13, 17, 21]  # without: every loud batch skips


class _Routed(LightningModule):
    """A router whose +inf sentinel the step never uses, then an expert that overflows float16 on its own."""

    def __init__(self, use_sentinel=False):
        super().__init__()
        self.router, self.expert = SentinelRouter(), nn.Linear(8, 1)
        self.use_sentinel = use_sentinel
        with torch.no_grad():
            self.expert.weight.fill_(1e4)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        gate, scores = self.router(x)
        out = self.expert(x.abs() + 1.0).float() * gate[:, :1]
        if self.use_sentinel:  # the step takes the sentinel in: its inf reaches the loss through the graph
            out = out + scores.float().amax(1, keepdim=True)
        return out.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(("use_sentinel", "named"), [(False, "expert"), (True, "router")])
def test_an_unused_sentinel_is_not_named_before_the_module_whose_inf_reached_the_loss(use_sentinel, named):
    """Issue 52.5: the router's +inf sentinel, which the loss never used (its graph says so), was named first; the
    expert that overflowed on its own is. Where the step takes the sentinel in, the router is named."""
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=3).fit(_Routed(use_sentinel), loader)
    assert plugin.history.num_skipped == 3
    assert [r["origin"].get("module") for r in reporter.skips] == [named] * 3


class _CriterionFed(LightningModule):
    """A head whose float16 output overflows to -inf in one class, straight into a loss module (`self.criterion`)."""

    def __init__(self):
        super().__init__()
        self.a, self.head, self.criterion = nn.Linear(16, 16), nn.Linear(16, 4), nn.CrossEntropyLoss()
        with torch.no_grad():
            self.head.weight[0].fill_(-1e3)
            self.head.bias[0] = -6e4

    def training_step(self, batch, batch_idx):
        (x,) = batch
        logits = self.head(self.a(x).abs() + 10)
        loss = self.criterion(logits, torch.zeros(len(x), dtype=torch.long))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    losses: list


def test_a_head_overflowing_to_minus_inf_into_a_loss_module_is_named_and_its_island_helps():
    """Break pass on issue 52: with `self.criterion = nn.CrossEntropyLoss()` the -inf straight into the loss was told
    "loss" (with F.cross_entropy: the head). The loss module is never the island; the head is, and its island makes
    the loss finite (measured)."""
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, max_warnings=0)
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed")
    loader = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=4)
    model = _CriterionFed()
    model.losses = []
    make_trainer(plugins=[plugin], callbacks=[reporter, advisor], max_steps=8).fit(model, loader)
    assert plugin.history.num_skipped > 0
    assert all(loss == float("inf") for loss in model.losses)
    assert {r["origin"].get("module") for r in reporter.skips} == {"head"}
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.fix.endswith('fp32_modules=["head"])')
    fixed = _CriterionFed()
    fixed.losses = []
    make_trainer(plugins=[eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})], max_steps=8).fit(fixed, loader)
    assert all(math.isfinite(loss) for loss in fixed.losses)


class _LogEnergy(nn.Module):
    """Log-energy features: float32 ``log(0)`` is ``-inf`` where a row of the batch is all zero (no bias)."""

    def __init__(self, guarded=False):
        super().__init__()
        self.proj, self.guarded = nn.Linear(8, 8, bias=False), guarded

    def forward(self, x):
        energy = self.proj(x).float().square()
        # the guard model_nonfinite prints for a log, pasted: torch.log(x.clamp_min(1e-12))
        return torch.log(energy.clamp_min(1e-12)) if self.guarded else torch.log(energy)


class _MaskedScores(nn.Module):
    """Look-alike: a module that makes a float32 ``-inf`` mask by ``masked_fill`` (a ``Div`` below it)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x).float() / 2
        return h.masked_fill(torch.arange(8) == 0, float("-inf"))


class _Attends(nn.Module):
    """Takes the float32 masked scores and its own float16 scores, which overflow on loud batches."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 1e3)

    def forward(self, x, mask):
        return torch.softmax(x @ self.weight + mask, dim=-1)  # float16 under autocast


class _FeaturesHead(LightningModule):
    def __init__(self, kind="log", guarded=False):
        super().__init__()
        self.kind, self.head = kind, nn.Linear(8, 1)
        self.feats = _LogEnergy(guarded) if kind == "log" else _MaskedScores()
        self.attend = _Attends()
        with torch.no_grad():
            self.head.weight.mul_(0.01)

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.feats(x) if self.kind == "log" else self.attend(x, self.feats(x))
        return (self.head(features).float() - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_modules_float32_log_of_zero_turned_into_nan_is_the_models_own_at_the_log():
    """Issue 52 (the limits page's float32 `-inf` maker): a module's float32 `log(0)` made NaN in the Linear after
    it, which was named, and its island did not help. Told at the log, as the model's own; the guard printed for the
    log, pasted, ends the skips."""
    from tests.helpers.models import loud_batches

    loud = (2, 5, 8)
    reporter, advisor = watched_fit(_FeaturesHead, loud_batches(10, loud, 0.0), 10, init_scale=2.0**8)
    told = {r["step"]: r["origin"] for r in reporter.skips}
    assert sorted(told) == list(loud)
    for step in loud[1:]:  # the first is read before the watch
        assert told[step]["module"] == "feats"
        assert told[step]["op"] == "LogBackward0"
        assert told[step]["float32"] == "nonfinite"
        assert "became nan in head" in told[step]["reason"]
    assert "fp32_module" not in [a.code for a in advisor.advice]
    (said,) = [a for a in advisor.advice if a.code == "model_nonfinite"]
    assert said.fix.startswith("torch.log(x.clamp_min(1e-12))")
    guarded = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, quiet=True)
    torch.manual_seed(0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**8)], callbacks=[guarded], max_steps=10).fit(
        _FeaturesHead(guarded=True), loud_batches(10, loud, 0.0)
    )
    assert guarded.skips == []


def test_a_float32_mask_a_module_made_does_not_make_an_overflow_the_models_own():
    """The look-alike: a module's float32 `-inf` mask (masked_fill, not a point op) into a module that overflows
    float16 on its own: that module is named, an island (float32 there ends it)."""
    from tests.helpers.models import loud_batches

    loud = (2, 5, 8)
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, quiet=True)
    torch.manual_seed(0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**8)], callbacks=[reporter], max_steps=10).fit(
        _FeaturesHead("mask"), loud_batches(10, loud, 100.0)
    )
    told = {r["step"]: r["origin"] for r in reporter.skips}
    assert sorted(told) == list(loud)
    for step in loud[1:]:
        assert told[step]["module"] == "attend"
        assert "float32" not in told[step]


def _fit_told(make_model, loader, steps=10, **plugin):
    """The origins a watched fit told, by step (``make_model`` called after the seed)."""
    reporter, _ = watched_fit(make_model, loader, steps, **plugin)
    return {r["step"]: r["origin"] for r in reporter.skips}


class _ReturnsItsLoss(nn.Module):
    """A model that computes and returns its loss (as transformers' do), overflowing float16 in its own code between
    two layers."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.l1(x)
        h = h * h
        return ((self.l2(h).float() - y) ** 2).mean()


class _HoldsAModelThatReturnsItsLoss(LightningModule):
    def __init__(self):
        super().__init__()
        self.hf = _ReturnsItsLoss()

    def training_step(self, batch, batch_idx):
        return self.hf(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_model_that_returns_its_loss_and_overflows_in_its_own_code_is_a_forward_origin():
    """Break pass: the model whose output is the loss was read as a loss class of your own, so an overflow in its
    code between its layers was told "loss" (no island helps). It is born there: that module, whose island ends it."""
    from tests.helpers.models import loud_batches

    loud = (2, 5, 8)
    told = _fit_told(_HoldsAModelThatReturnsItsLoss, loud_batches(10, loud, 1000.0), init_scale=2.0**8)
    assert sorted(told) == list(loud)
    assert [(told[s]["phase"], told[s].get("module")) for s in loud[1:]] == [("forward", "hf")] * 2
    fixed = _fit_told(
        _HoldsAModelThatReturnsItsLoss, loud_batches(10, loud, 1000.0), init_scale=2.0**8, fp32_modules=["hf"]
    )
    assert fixed == {}


class _LogThen(nn.Module):
    """Log-energy features, then ``post`` (a normalisation, a transpose): float32 ``log(0)`` on all-zero rows."""

    def __init__(self, post):
        super().__init__()
        self.proj, self.post = nn.Linear(8, 8, bias=False), post

    def forward(self, x):
        log = torch.log(self.proj(x).float().square())
        return {
            "norm": lambda: (log - 1.0) / 2.0,
            "t": lambda: log.t().t(),
            "views": lambda: log.unsqueeze(0)[0][[0, 1, 2, 3]].chunk(1, -1)[0][:, :8].narrow(1, 0, 8),
            "plain": lambda: log,
        }[self.post]()


class _TwoMakers(LightningModule):
    """``feats``' -inf reaches the head (NaN); ``other``'s only an ``exp`` (0, harmless), and it ran after."""

    def __init__(self, post="plain", second=False):
        super().__init__()
        self.feats, self.other, self.head = _LogThen(post), _LogThen("plain"), nn.Linear(8, 1)
        self.second = second
        with torch.no_grad():
            self.head.weight.mul_(0.01)

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.feats(x)
        extra = 0 * self.other(x).exp().mean() if self.second else 0
        return (self.head(features).float() - y).square().mean() + extra

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(("post", "second"), [("norm", False), ("t", False), ("views", False), ("plain", True)])
def test_the_float32_minus_inf_maker_is_the_one_whose_value_reached_the_nan_at_the_op_that_made_it(post, second):
    """Break pass: a normalisation after the log (`(log - 1) / 2`) was told as the division (its guard does nothing);
    `.t()` fell back to the head's island; with two makers the latest (whose -inf reached only an exp) was named."""
    from tests.helpers.models import loud_batches

    loud = (2, 5, 8)
    told = _fit_told(lambda: _TwoMakers(post, second), loud_batches(10, loud, 0.0), init_scale=2.0**8)
    assert sorted(told) == list(loud)
    for step in loud[1:]:
        assert (told[step]["module"], told[step]["op"], told[step]["float32"]) == ("feats", "LogBackward0", "nonfinite")


class _MaskThenScale(nn.Module):
    """A float32 -inf mask by masked_fill, then a temperature division (a point op above the maker): a constant, or
    a learned one (a second operand with a graph)."""

    def __init__(self, learned=False):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.tau = nn.Parameter(torch.tensor(2.0)) if learned else 2.0

    def forward(self, x):
        return self.proj(x).float().masked_fill(torch.arange(8) == 0, float("-inf")) / self.tau


class _ScaledMaskAttends(LightningModule):
    def __init__(self, learned=False):
        super().__init__()
        self.mask, self.attend, self.head = _MaskThenScale(learned), _Attends(), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.head(self.attend(x, self.mask(x)).float()).float() - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("learned", [False, True], ids=["constant", "learned"])
def test_a_mask_divided_by_a_temperature_keeps_naming_the_module_that_overflowed(learned):
    """Break passes: `masked_fill(...) / 2.0` was read as a division making -inf (the model's own), and so was a
    learned temperature (a second operand with a graph); the mask's maker is masked_fill, so the module that took it
    and overflowed on its own is named, and its island ends the forward-born skips. (A learned temperature over a
    -inf makes NaN gradients at every step: those skips are born in backward.)"""
    from tests.helpers.models import loud_batches

    loud = (2, 5, 8)
    told = _fit_told(lambda: _ScaledMaskAttends(learned), loud_batches(10, loud, 100.0), init_scale=2.0**8)
    forward = {s: o for s, o in told.items() if o["phase"] != "backward"}
    assert sorted(forward) == list(loud)
    assert [(told[s].get("module"), told[s].get("float32")) for s in loud[1:]] == [("attend", None)] * 2
    island = _fit_told(
        lambda: _ScaledMaskAttends(learned), loud_batches(10, loud, 100.0), init_scale=2.0**8, fp32_modules=["attend"]
    )
    assert [o["phase"] for o in island.values()] == ["backward"] * len(island)  # no forward-born skip left
    assert island == {} or learned


class _LogIntoLongRecurrence(LightningModule):
    """Log-energy frames (one silent frame: float32 log(0)) into a hand-written recurrence over 500 frames: the
    NaN's graph holds thousands of nodes between the recurrence's output and the log."""

    def __init__(self):
        super().__init__()
        self.feats = _LogThen("plain")
        self.rnn = _Recurrence()
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.head(self.rnn(self.feats(x))).float() - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Recurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.wx, self.wh = nn.Parameter(torch.randn(8, 8) * 0.3), nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, frames):
        h = frames.new_zeros(frames.shape[0], 8)
        for t in range(frames.shape[1]):
            h = torch.tanh(frames[:, t] @ self.wx + h @ self.wh)
        return h


def test_the_float32_minus_inf_maker_is_found_below_a_long_recurrence():
    """Break pass: the search from the NaN down to the log gave up after 2,000 nodes, so a 500-frame recurrence was
    named (its island cannot help); the search now reads the loss's graph it already holds."""
    x = torch.randn(12, 500, 8, generator=torch.Generator().manual_seed(0))
    x[4, 3] = x[8, 3] = 0  # a silent frame in the batches of steps 2 and 4
    told = _fit_told(
        _LogIntoLongRecurrence, DataLoader(TensorDataset(x, torch.zeros(12, 1)), batch_size=2), 6, init_scale=2.0**8
    )
    assert sorted(told) == [2, 4]
    assert (told[4]["module"], told[4]["op"], told[4]["float32"]) == ("feats", "LogBackward0", "nonfinite")


def test_the_makers_are_matched_in_one_walk_of_the_graph_a_skip(monkeypatch):
    """Third break pass: each maker walked the graph below the NaN again (a skip took ~10 s with 400 makers over a
    6,000-step recurrence); the graph below it is walked once a skip, whatever the number of makers."""
    from lightning_amp_plus.forensics import verdict
    from tests.helpers.models import loud_batches

    walks = []
    under = verdict.LossGraph.under
    monkeypatch.setattr(verdict.LossGraph, "under", lambda self, tops: walks.append(tops) or under(self, tops))
    loud = (2, 5, 8)
    told = _fit_told(lambda: _TwoMakers("plain", second=True), loud_batches(10, loud, 0.0), init_scale=2.0**8)
    assert told[5]["module"] == "feats"  # the earlier maker: the later one's output is not below the NaN
    assert len(walks) == len(told) == len(loud)  # one walk a skip, two makers each time
