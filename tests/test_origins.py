"""OriginFinder: the replay leaves no trace, containers' children are origins, fp16 overflow vs NaN in any precision."""

import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.origins import OriginFinder, call_frontier, leaves_no_trace
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


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
def test_the_replay_leaves_the_model_exactly_as_it_found_it(diagnostic):
    plain, plain_plugin = _fit([NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False)])
    callback = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0) if diagnostic == "reporter" else AmpAdvisor()
    told, told_plugin = _fit([callback])
    assert told_plugin.history.num_skipped == plain_plugin.history.num_skipped == 10  # 10 replays ran
    for (name, a), (_, b) in zip(plain.state_dict().items(), told.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # weights and the assigned buffer, bit for bit
    assert told.tracker.calls == plain.tracker.calls
    assert torch.equal(told.tracker.last, plain.tracker.last)
    reporter = callback if diagnostic == "reporter" else callback._reporter
    assert [r["origin"] for r in reporter.skips][:1] == [{"phase": "loss"}]  # it did replay


def test_a_replay_that_writes_a_parameter_in_place_is_an_error():
    class Writer(nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.mul_(1.0)
            return super().forward(x)

    module = nn.Sequential(Writer(2, 2))
    with (
        pytest.raises(RuntimeError, match=r"changed 1 parameter\(s\) in place.*find_origin=False"),
        leaves_no_trace(module, "cpu"),
    ):
        module(torch.ones(1, 2))


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


def test_an_overflow_born_inside_a_module_list_is_named_and_its_island_fixes_it():
    advisor = AmpAdvisor()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=8).fit(Stack())
    assert plugin.history.num_skipped == 8
    origins = [r["origin"] for r in advisor._reporter.skips]
    assert origins[0] == {"phase": "forward", "module": "layers.1", "kind": "inf", "float32": "finite"}
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["layers.1"])'
    assert "model_nonfinite" not in [a.code for a in advisor.advice]  # finite in float32: fp16's overflow
    fixed = eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})  # pasted as printed
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


def test_nan_the_model_makes_in_any_precision_is_told_apart_from_an_fp16_overflow():
    advisor = AmpAdvisor()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=6).fit(Padded())
    assert plugin.history.num_skipped == 6
    assert advisor._reporter.skips[0]["origin"] == {
        "phase": "forward",
        "module": "attn",
        "kind": "nan",
        "float32": "nonfinite",
    }
    codes = [a.code for a in advisor.advice]
    assert codes[0] == "model_nonfinite"
    assert "fp32_module" not in codes  # an island would change nothing: float32 makes the same NaN
    assert "bf16" not in codes
    (advice,) = [a for a in advisor.advice if a.code == "model_nonfinite"]
    assert "in any precision" in advice.message
    # the island the old advice proposed, measured: it does not help
    island = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["attn"])
    make_trainer(plugins=[island], max_steps=6).fit(Padded())
    assert island.history.num_skipped == 6
    # what the fix says (one unmasked key per row), measured: it does
    fixed = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[fixed], max_steps=6).fit(Padded(unmask_one=True))
    assert fixed.history.num_skipped == 0


def test_the_collapse_error_says_what_the_advisor_says():
    advisor = AmpAdvisor(print_advice=False)
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    with pytest.raises(LossScaleCollapseError) as error:
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter, advisor], max_steps=10
        ).fit(Padded())
    first = advisor.advice[0]
    assert first.code == "model_nonfinite"
    assert f"{first.message} HINT: {first.fix}" in str(error.value)
    assert "precision='bf16-mixed'" not in str(error.value)  # no scaling hint beside it


def test_a_finder_without_a_batch_tells_nothing():
    finder = OriginFinder()
    assert finder.origin() is None
    finder.start_batch(torch.ones(2))
    assert finder.origin() is None  # not attached to a module: only the batch could be told
    finder.start_batch(torch.tensor([float("inf")]))
    assert finder.origin() == {"phase": "input"}
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


@pytest.mark.parametrize("diagnostic", ["replay", "reference"])
def test_host_random_state_and_nested_containers_are_left_as_found(diagnostic):
    from lightning_amp_plus import GradUnderflowMonitor

    base = _fit_augmented([NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False)])
    extra = (
        [NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)]
        if diagnostic == "replay"
        else [
            NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False),
            GradUnderflowMonitor(every_n_steps=1),
        ]
    )
    told = _fit_augmented(extra)
    for (name, a), (_, b) in zip(base.state_dict().items(), told.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert told.augment.calls == base.augment.calls == {"n": 10}
    assert told.augment.history == base.augment.history
    assert list(told.augment.recent) == list(base.augment.recent)
    assert told.augment.tags == base.augment.tags
    assert told.augment.recent.maxlen == 3


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


def test_the_replay_runs_modules_only_never_the_training_steps_own_code():
    def run(find_origin):
        torch.manual_seed(0)
        model = _StepSideEffects(poison={2: "inf", 4: "nan"})
        reporter = NaNSkipReporter(max_consecutive_skips=None, find_origin=find_origin)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=6).fit(model)
        return model, reporter

    model, reporter = run(True)
    assert [r["origin"] for r in reporter.skips] == [{"phase": "loss"}, {"phase": "loss"}]
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


def test_a_replay_that_would_write_parameters_stops_the_run_naming_who_wrote_and_the_way_out(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_amp_plus import GradUnderflowMonitor

    with pytest.raises(RuntimeError, match=r"^`OriginFinder`: a module's forward changed 1 .*find_origin=False"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[NaNSkipReporter()], max_steps=4).fit(
            _ClampsInForward(poison={1: "inf"})
        )
    with pytest.raises(RuntimeError, match=r"^`GradUnderflowMonitor`: the float32 reference.*exact=False"):
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed")],
            callbacks=[GradUnderflowMonitor(every_n_steps=1)],
            logger=CSVLogger(tmp_path),
            max_steps=2,
        ).fit(_EmaInStep())
