"""The advisor reads non-finite values right: each reading on a run that has the problem, its fix applied as printed
and measured, and its healthy look-alike (issue 33's cases: NaN-coded missing values, a -inf overflow, an island that
only moves the overflow, figures of gradients float16 never held)."""

import math

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, GradUnderflowMonitor, NaNSkipReporter
from tests.helpers.models import SentinelRouter, TinyModel
from tests.helpers.trainer import make_trainer


def _fit(model, loader=None, plugin=None, callbacks=(), steps=12):
    advisor = AmpAdvisor(print_advice=False)
    plugin = plugin or AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[advisor, *callbacks], max_steps=steps).fit(model, loader)
    return advisor, plugin


def _applied(fix):
    return eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})


def _codes(advisor):
    return [a.code for a in advisor.advice]


# ------------------------------------------------------------------------------------------ NaN-coded missing values
class Tabular(TinyModel):
    """Missing values stored as NaN, filled in the step before the model sees them (`torch.nan_to_num`)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(torch.nan_to_num(x)).float(), y)
        return loss * 1e5  # large enough to overflow in backward at the initial scale


def _tabular(nan):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    if nan:
        x[::3, 2] = float("nan")
    else:
        x[::3, 2] = 0.0  # what nan_to_num makes of them: the same computation, cleaned in the data set
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).nan_to_num()), batch_size=4)


def test_nan_coded_values_the_step_fills_are_not_the_batchs_fault():
    torch.manual_seed(0)
    coded = Tabular()
    advisor, plugin = _fit(coded, _tabular(nan=True))
    torch.manual_seed(0)
    cleaned = Tabular()
    clean_advisor, clean_plugin = _fit(cleaned, _tabular(nan=False))
    for (name, a), (_, b) in zip(coded.state_dict().items(), cleaned.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # bit-identical: the NaN never reached the model
    assert plugin.history.skipped_steps == clean_plugin.history.skipped_steps
    assert plugin.history.num_skipped > 0
    origins = [r["origin"] for r in advisor._reporter.skips]
    assert [o["phase"] for o in origins] == [r["origin"]["phase"] for r in clean_advisor._reporter.skips]
    assert {o["phase"] for o in origins} == {"backward"}  # the batch's NaN said beside it, never blamed
    assert all(o.get("batch") == "nonfinite" for o in origins)
    assert _codes(advisor) == _codes(clean_advisor)
    assert "nonfinite_loss" not in _codes(advisor)  # no `assert` on the batch that would stop training at batch 0


class Unfilled(Tabular):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)  # the NaN reaches the model


def test_nan_that_reaches_the_model_is_the_batchs():
    advisor, _ = _fit(Unfilled(), _tabular(nan=True))
    assert {r["origin"]["phase"] for r in advisor._reporter.skips} == {"input"}
    assert _codes(advisor)[0] == "nonfinite_loss"


# ------------------------------------------------------------------------------------------ a -inf overflow
class Energy(nn.Module):
    """An energy `-(x @ W)^2 / 1e5`: the square overflows float16, so its output is -inf; in float32 it is finite
    and fits float16 (the next module takes it as it comes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(60.0)

    def forward(self, x):
        return -(self.proj(x) ** 2) / 1e5


class EnergyModel(TinyModel):
    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=1e-4)
        self.energy = Energy()

    def forward(self, x):
        return self.net(self.energy(x * 10))


def test_a_minus_inf_overflow_is_no_mask_and_its_island_fixes_it():
    advisor, plugin = _fit(EnergyModel())
    assert plugin.history.num_skipped == 12
    origin = advisor._reporter.skips[1]["origin"]  # watched from the second skip on
    # NaN made of energy's half-precision -inf in the next module: named there, with where the -inf came from
    assert (origin["module"], origin["fed_by"]) == ("net.0", "energy")
    assert "model_nonfinite" not in _codes(advisor)  # not called the model's own, no nan_to_num to hide it
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["net.0", "energy"]
    assert "It took a float16 -inf from energy" in advice.message
    _, fixed = _fit(EnergyModel(), plugin=_applied(advice.fix))
    assert fixed.history.num_skipped == 0
    _, alone = _fit(EnergyModel(), plugin=AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["net.0"]))
    assert alone.history.num_skipped > 0  # the -inf's maker is needed: the island where NaN appeared alone fails
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None, quiet=True)
    _fit(EnergyModel(), callbacks=[replayed])
    measured = [r["origin"] for r in replayed.skips]  # the replay watches from the start
    assert measured
    assert all(o["float32"] == "finite" and o["islands"] == ["net.0", "energy"] for o in measured)
    _, bf16 = _fit(EnergyModel(), plugin=AmpPlusPrecision("bf16-mixed"))
    assert bf16.history.num_skipped == 0


class SetPooled(TinyModel):
    """Sum pooling over a large set in the LightningModule's own code: the float16 sum overflows to -inf (beside
    other, finite sums), between two modules. The targets hold NaN for missing labels, masked in the loss."""

    def __init__(self):
        super().__init__(lr=1e-4)
        self.embed = nn.Linear(8, 8)
        with torch.no_grad():
            self.embed.bias[:4] = -16.0  # the first four pooled features overflow, the others stay finite

    def training_step(self, batch, batch_idx):
        x, y = batch
        pooled = self.embed(x).sum(1)  # float16: below -65504 in some rows, -inf there
        known = ~torch.isnan(y)
        return nn.functional.mse_loss(self.net(pooled / x.shape[1]).float()[known], y[known])


def _sets(nan_labels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 10000, 8, generator=g).abs()
    y = torch.randn(32, 1, generator=g)
    if nan_labels:
        y[::2] = float("nan")  # missing labels, never reaching a module
    return DataLoader(TensorDataset(x, y), batch_size=4)


def test_a_minus_inf_overflow_in_the_modules_own_code_is_its_own_whatever_the_batch_holds():
    for nan_labels in (False, True):
        advisor, plugin = _fit(SetPooled(), _sets(nan_labels), steps=4)
        assert plugin.history.num_skipped == 4
        origins = [r["origin"] for r in advisor._reporter.skips][1:]  # the first one starts the watch
        assert origins == [{"phase": "forward", "module": "", "kind": "inf"}] * 3, nan_labels
        assert _codes(advisor) == ["own_code"]  # neither the batch's nor, unmeasured, any precision's
    (advice,) = advisor.advice
    reporter = eval(advice.fix.split("  #")[0], {"NaNSkipReporter": NaNSkipReporter})  # pasted as printed
    told, _ = _fit(SetPooled(), _sets(True), callbacks=[reporter], steps=4)
    assert [r["origin"].get("float32") for r in reporter.skips] == [None] + ["finite"] * 3  # rerun in float32
    assert _codes(told) == ["bf16"]
    (bf16_advice,) = told.advice
    assert "rerun in float32 and under bfloat16 is finite: float16's range fails there" in bf16_advice.message
    _, bf16 = _fit(SetPooled(), _sets(True), plugin=_applied(bf16_advice.fix), steps=4)
    assert bf16.history.num_skipped == 0  # an overflow: float32's range holds it


class SetCentred(SetPooled):
    """The pooled features centred over the batch in the step's own code: the overflow's -inf minus -inf is NaN at
    every sample, the same kind as the NaN-coded labels the batch holds at some."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        pooled = self.embed(x).sum(1)
        pooled = pooled - pooled.mean(0)
        known = ~torch.isnan(y)
        return nn.functional.mse_loss(self.net(pooled / x.shape[1]).float()[known], y[known])


def test_nan_labels_do_not_make_the_own_codes_nan_the_batchs():
    for nan_labels in (False, True):
        advisor, plugin = _fit(SetCentred(), _sets(nan_labels), steps=3)
        assert plugin.history.num_skipped == 3
        told = {"phase": "forward", "module": "", "kind": "nan"} | ({"batch": "nonfinite"} if nan_labels else {})
        assert [r["origin"] for r in advisor._reporter.skips][1:] == [told] * 2  # the first one starts the watch
        assert "nonfinite_loss" not in _codes(advisor)  # its `assert` on the batch would stop training at batch 0
    (advice,) = advisor.advice
    assert "The batch held inf/nan of that kind too" in advice.message  # said, not blamed


class MinMax(TinyModel):
    """Min-max normalisation in the step's own code of features near 1000 spread by about 0.05: float16 (and
    bfloat16) round the module's output to steps of 0.5, so the spread is 0 and 0/0; float32 keeps it. Precision,
    not range."""

    def __init__(self):
        super().__init__(lr=1e-4)
        self.embed = nn.Linear(8, 8)
        with torch.no_grad():
            self.embed.weight.mul_(0.05)
            self.embed.bias.fill_(1000.0)

    def forward(self, x):
        h = self.embed(x).float()
        return self.net((h - h.amin(0)) / (h.amax(0) - h.amin(0)))


def test_an_own_code_precision_loss_is_no_bf16_case_and_the_measured_island_fixes_it():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(MinMax(), callbacks=[reporter], steps=4)
    assert plugin.history.num_skipped == 4
    told = {(r["origin"]["float32"], r["origin"]["bf16"], tuple(r["origin"]["islands"])) for r in reporter.skips[1:]}
    assert told == {("finite", "nonfinite", ("embed",))}  # the module whose output the code takes in
    assert _codes(advisor) == ["own_code"]  # not bf16: bfloat16 has less precision still
    (advice,) = advisor.advice
    assert "loses the precision there" in advice.message
    assert advice.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["embed"])'
    _, bf16 = _fit(MinMax(), plugin=AmpPlusPrecision("bf16-mixed"), steps=4)
    assert bf16.history.num_skipped == 4  # bf16, measured: no help
    _, fixed = _fit(MinMax(), plugin=_applied(advice.fix), steps=4)
    assert fixed.history.num_skipped == 0  # the fix as printed: it trains


class AuxHeads(MinMax):
    """MinMax with four auxiliary heads called after `embed`, before the own code: the island it needs is not the
    module called last."""

    def __init__(self):
        super().__init__()
        self.aux = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        h = self.embed(x)
        for head in self.aux:
            head(x)  # called, its output unused by the code below
        h = h.float()
        return self.net((h - h.amin(0)) / (h.amax(0) - h.amin(0)))


def test_the_measured_island_is_the_module_the_code_reads_not_the_one_called_last():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    advisor, _ = _fit(AuxHeads(), callbacks=[reporter], steps=3)
    assert {tuple(r["origin"]["islands"]) for r in reporter.skips[1:]} == {("embed",)}  # the first starts the watch
    (advice,) = advisor.advice
    _, fixed = _fit(AuxHeads(), plugin=_applied(advice.fix), steps=3)
    assert fixed.history.num_skipped == 0


class BiasedAttention(nn.Module):
    """Attention scores over the 8 features of each sample, with an additive bias or mask taken as an argument."""

    def forward(self, x, bias):
        scores = x[:, :, None] * x[:, None, :] + bias
        return (torch.softmax(scores.float(), -1) @ x[:, :, None].float()).squeeze(-1)


class Biased(TinyModel):
    """A healthy model whose only fault is a too-high `init_scale`: the step's own code (or a module, through a view)
    builds a float32 causal position bias, several finite values beside -inf, for an attention child."""

    def __init__(self, made_by):
        super().__init__()
        self.made_by, self.position, self.attend = made_by, AlibiBias(), BiasedAttention()

    def forward(self, x):
        if self.made_by == "module":
            bias = self.position(x.float()).unsqueeze(0)  # a view of the module's output: a new tensor
        else:
            i = torch.arange(8, device=x.device)
            distance = (i[None] - i[:, None]).float()
            bias = (-0.5 * distance.abs()).masked_fill(distance > 0, float("-inf"))[None]
        return self.net(self.attend(x, bias))


def test_a_float32_position_bias_made_by_the_step_is_no_origin_and_the_scale_is_told():
    for made_by in ("own code", "module"):
        advisor, plugin = _fit(Biased(made_by), plugin=AmpPlusPrecision("16-mixed", init_scale=2.0**24), steps=12)
        assert plugin.history.num_skipped >= 2
        assert {r["origin"]["phase"] for r in advisor._reporter.skips} == {"backward"}, made_by
        assert "init_scale" in _codes(advisor)
        assert not {"own_code", "bf16", "model_nonfinite"} & set(_codes(advisor))


def test_a_batch_mask_of_zeros_large_negatives_and_minus_inf_is_no_bad_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    mask = torch.zeros(32, 8)
    mask[:, 5:] = -1e4  # soft-masked (as a `finfo.min`-style mask)
    mask[::4, 7] = float("-inf")  # hard-masked

    class Masked(TinyModel):
        def __init__(self):
            super().__init__()
            self.attend = BiasedAttention()

        def training_step(self, batch, batch_idx):
            x, mask, y = batch
            return nn.functional.mse_loss(self(self.attend(x, mask[:, None, :])).float(), y) * 1e4

    advisor, plugin = _fit(Masked(), DataLoader(TensorDataset(x, mask, y), batch_size=4), steps=6)
    assert plugin.history.num_skipped >= 1
    assert "input" not in {r["origin"]["phase"] for r in advisor._reporter.skips}
    assert "nonfinite_loss" not in _codes(advisor)


class OwnSqrt(TinyModel):
    """The look-alike: the LightningModule's own code takes the square root of a negative value (NaN in float32
    too)."""

    def forward(self, x):
        return self.net(torch.sqrt(x - 0.5))


def test_a_nan_the_modules_own_code_makes_in_any_precision_is_no_bf16_case():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(OwnSqrt(), callbacks=[reporter], steps=4)
    assert plugin.history.num_skipped == 4
    assert [r["origin"] for r in reporter.skips][1:] == [
        {"phase": "forward", "module": "", "kind": "nan", "float32": "nonfinite"}
    ] * 3  # watched from the second skip on, then rerun in float32
    assert _codes(advisor) == ["model_nonfinite"]  # not bf16, not own_code's "which of the two"
    _, bf16 = _fit(OwnSqrt(), plugin=AmpPlusPrecision("bf16-mixed"), steps=4)
    assert bf16.history.num_skipped == 4  # bf16 would not have helped


class Attend(nn.Module):
    """Attention that takes an additive key mask (0 keep, -inf padding), as `nn.Transformer`'s float masks."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x, key_mask):
        q, k = self.qk(x).chunk(2, -1)
        weights = torch.softmax((q @ k.transpose(1, 2)).float() + key_mask[:, None, :], -1)
        return (weights @ x.float()).mean(1)


class KeyMasked(TinyModel):
    """The mask comes with the batch; some samples have every key masked: their attention row is NaN in any
    precision."""

    def __init__(self):
        super().__init__(lr=1e-3)
        self.attend = Attend()

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        return nn.functional.mse_loss(self.net(self.attend(x, mask)).float(), y)


def test_an_additive_mask_in_the_batch_is_no_bad_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, 8, generator=g), torch.randn(16, 1, generator=g)
    lengths = torch.randint(1, 7, (16,), generator=g)
    lengths[::4] = 0  # an empty sample in every batch: its row is all -inf
    mask = torch.zeros(16, 6).masked_fill(torch.arange(6)[None] >= lengths[:, None], float("-inf"))
    loader = DataLoader(TensorDataset(x, mask, y), batch_size=4)
    advisor, plugin = _fit(KeyMasked(), loader, steps=4)
    assert plugin.history.num_skipped == 4
    origins = [r["origin"] for r in advisor._reporter.skips][1:]  # the first one starts the watch
    assert origins == [{"phase": "forward", "module": "attend", "kind": "nan"}] * 3
    assert "nonfinite_loss" not in _codes(advisor)  # no `assert` on the batch, which holds -inf by design
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None, max_warnings=0)
    measured, _ = _fit(KeyMasked(), loader, callbacks=[replayed], steps=4)
    origins = [r["origin"] for r in replayed.skips]
    assert origins == [{"phase": "forward", "module": "attend", "kind": "nan", "float32": "nonfinite"}] * 4
    assert _codes(measured)[0] == "model_nonfinite"  # "give every attention row one unmasked key"


class AlibiBias(nn.Module):
    """A causal position bias (ALiBi, T5 relative positions): slope times distance, -inf above the diagonal. Its
    -inf sits beside other finite values, and float32 makes it too: by design, no origin."""

    def forward(self, x):
        i = torch.arange(x.shape[-1], device=x.device)
        distance = (i[None] - i[:, None]).to(x.dtype)
        return (-0.5 * distance.abs()).masked_fill(distance > 0, float("-inf"))


class Alibi(TinyModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bias = AlibiBias()

    def forward(self, x):
        scores = x[:, :, None] * x[:, None, :] + self.bias(x)
        return self.net((torch.softmax(scores.float(), -1) @ x[:, :, None].float()).squeeze(-1))


def test_a_position_bias_whose_minus_inf_is_by_design_is_no_origin():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(Alibi(grad_poison={2: "net.0.weight", 5: "net.0.weight"}), callbacks=[reporter], steps=8)
    assert plugin.history.skipped_steps == [2, 5]
    assert [r["origin"] for r in reporter.skips] == [{"phase": "backward"}] * 2  # not the bias, not the attention
    assert "model_nonfinite" not in _codes(advisor)


class MaskMaker(nn.Module):
    """The look-alike: a module whose -inf is by design (an additive attention mask), in float32 too."""

    def forward(self, x):
        mask = torch.zeros_like(x)
        mask[:, ::2] = float("-inf")
        return mask


class Masked(TinyModel):
    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=1e-3)
        self.masker = MaskMaker()

    def forward(self, x):
        weights = (x + self.masker(x)).softmax(-1)
        return self.net(weights)


def test_a_minus_inf_mask_by_design_is_no_origin():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(Masked(), callbacks=[reporter])
    assert plugin.history.num_skipped <= 1  # at most the calibration's backward
    assert all(r["origin"]["phase"] == "backward" for r in reporter.skips)
    assert not {"fp32_module", "model_nonfinite"} & set(_codes(advisor))


# ------------------------------------------------------------------------------------------ an island that moves it
class Pooled(TinyModel):
    """Sum pooling of 8.2e4 (finite in float32, beyond 65504): an island on `pool` alone hands `head` a float32 value
    it casts back to float16."""

    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=0.0)
        self.pool = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.pool.weight.fill_(0.0)
            self.pool.bias.fill_(8.2e4)
            self.head.weight.fill_(1e-5)  # a moderate output: only the forward overflows

    def forward(self, x):
        return self.head(self.pool(x))


def test_the_island_fix_names_every_module_the_value_crosses():
    """Watched, each run names where the value overflows next, and its fix adds that island to the run's; the
    replay measures the whole set in one run. Either chain ends in the fix that works, pasted as printed."""
    advisor, plugin = _fit(Pooled())
    assert plugin.history.num_skipped == 12
    (first,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert first.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["pool"])'
    moved, half = _fit(Pooled(), plugin=_applied(first.fix))
    assert half.history.num_skipped == 12  # the first island alone only moves the overflow to `head`
    (second,) = [a for a in moved.advice if a.code == "fp32_module"]
    assert second.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["pool", "head"])'
    _, fixed = _fit(Pooled(), plugin=_applied(second.fix))
    assert fixed.history.num_skipped == 0  # measured: both islands, as printed
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None, max_warnings=0)
    measured, _ = _fit(Pooled(), callbacks=[replayed], steps=8)  # before the scale reaches its floor
    (once,) = [a for a in measured.advice if a.code == "fp32_module"]
    assert once.fix == second.fix


# ---------------------------------------------------------------------------------- gradients float16 never held
class PositionEmbedded(TinyModel):
    """A positional embedding added in float32 (as a ViT's `pos_embed`): its scaled gradient is the run's largest,
    beyond 65504, yet float16 never held it."""

    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=0.0)
        self.pos_embed = nn.Parameter(torch.zeros(8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[0](x).float()  # the float16 matmul's output, upcast
        h = torch.cat([h[:, :8] + self.pos_embed, h[:, 8:]], dim=1)  # float32
        out = self.net[2](torch.relu(h)).float()
        return nn.functional.mse_loss(out, y) * 1e3 + self.pos_embed.sum() * 1e4


def test_headroom_is_of_the_gradients_float16_held():
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    _fit(PositionEmbedded(), plugin=AmpPlusPrecision("16-mixed", init_scale=2.0**7), callbacks=[monitor])
    applied = [m for m in monitor.measurements if m["headroom_bits"] is not None]
    assert len(applied) >= 10
    for m in applied:
        assert "pos_embed" not in {w["name"] for w in m["worst"]}
        assert m["headroom_bits"] > 0  # the pos_embed's 1.3e5 (scaled, in float32) is no overflow to come
    largest = 1e4 * min(m["scale"] for m in applied)  # d(loss)/d(pos_embed) per element, scaled
    assert math.log2(65504.0 / largest) < 0  # what the figure would have read with it counted


def test_an_islands_gradients_leave_the_advisors_underflow_figures():
    class Adapter(TinyModel):
        def __init__(self):
            super().__init__(optimizer="fused_sgd", lr=0.0)
            self.adapter = nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 1e-4

        def forward(self, x):
            return self.net(self.adapter(x))

    def worst(islands):
        monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0, fp32_modules=islands)
        _fit(Adapter(), plugin=plugin, callbacks=[monitor], steps=3)
        return {w["name"] for m in monitor.measurements for w in m["worst"]}

    assert {"adapter.weight", "adapter.bias"} <= worst(None)
    assert not {"adapter.weight", "adapter.bias"} & worst(["adapter"])  # computed in float32: not float16's loss


def test_a_bf16_runs_own_code_islands_are_measured_under_bf16_and_the_fix_trains(monkeypatch):
    from lightning_amp_plus.forensics.opt_in import rerun as _rerun

    tried = []
    real = _rerun._finite_as

    def spy(module, record, device_type, dtype=None, islands=()):
        if islands:
            tried.append(dtype)
        return real(module, record, device_type, dtype, islands)

    monkeypatch.setattr(_rerun, "_finite_as", spy)
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(MinMax(), plugin=AmpPlusPrecision("bf16-mixed"), callbacks=[reporter], steps=3)
    assert plugin.history.num_skipped == 3
    assert tried
    assert set(tried) == {torch.bfloat16}  # the run's own precision, not float16's
    (advice,) = advisor.advice
    assert advice.fix == 'AmpPlusPrecision("bf16-mixed", fp32_modules=["embed"])'
    monkeypatch.undo()
    _, fixed = _fit(MinMax(), plugin=_applied(advice.fix), steps=3)
    assert fixed.history.num_skipped == 0  # the fix as printed: it trains


# ------------------------------------------------------------------------------ three towers, none with a majority
class Towers(TinyModel):
    """Three towers, each overflowing float16 on the batches that carry its feature large (1e3 x 100 = 1e5): none is
    born in most skips, the three together in all of them."""

    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=0.0)
        self.towers = nn.ModuleList(nn.Linear(8, 1) for _ in range(3))
        with torch.no_grad():
            for k, tower in enumerate(self.towers):
                tower.weight.fill_(0.01)
                tower.weight[0, k] = 1e3
                tower.bias.zero_()

    def forward(self, x):
        return torch.cat([tower(x).float() for tower in self.towers], 1).relu().log1p().sum(1, keepdim=True)


def _towers(large):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    for b in range(12):
        if large and b % 4 != 3:  # every fourth batch clean
            x[4 * b : 4 * b + 4, b % 3] = 100.0
    return DataLoader(TensorDataset(x, torch.zeros(48, 1)), batch_size=4)


def test_three_towers_each_overflowing_on_some_batches_get_every_towers_island():
    advisor, plugin = _fit(Towers(), _towers(large=True))
    assert plugin.history.num_skipped == 9
    origins = [r["origin"] for r in advisor._reporter.skips]
    assert sorted({o.get("module") for o in origins[1:]}) == ["towers.0", "towers.1", "towers.2"]
    assert "healthy" not in " ".join(a.message for a in advisor.advice)
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["modules"] == {"towers.0": 2, "towers.1": 3, "towers.2": 3}  # the first one: unwatched
    assert sorted(advice.evidence["islands"]) == ["towers.0", "towers.1", "towers.2"]
    assert "the forwards of towers." in advice.message
    _, fixed = _fit(Towers(), _towers(large=True), plugin=_applied(advice.fix))
    assert fixed.history.num_skipped == 0  # measured: the three islands, as printed
    healthy, quiet = _fit(Towers(), _towers(large=False))  # the look-alike: the same towers, no large feature
    assert quiet.history.num_skipped == 0
    assert "fp32_module" not in _codes(healthy)


def _towers_together(large):
    """Every batch but every fourth carries all three towers' features large: the towers overflow in the same steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    for b in range(12):
        if large and b % 4 != 3:
            x[4 * b : 4 * b + 4, :3] = 100.0
    return DataLoader(TensorDataset(x, torch.zeros(48, 1)), batch_size=4)


def test_towers_overflowing_in_the_same_step_are_all_named_in_one_run_and_the_fix_trains():
    """Three modules born on their own in each skipped step: the first is named, the others are ``also`` (issue 52.2);
    one run prints all three islands (before: one a run, three runs to a fix), pasted it trains; auto_islands adds
    all three at the first watched skip."""
    advisor, plugin = _fit(Towers(), _towers_together(large=True))
    assert plugin.history.num_skipped == 9
    origins = [r["origin"] for r in advisor._reporter.skips]
    assert origins[1]["module"] == "towers.0"
    assert origins[1]["also"] == ["towers.1", "towers.2"]
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["modules"] == {"towers.0": 8, "towers.1": 8, "towers.2": 8}
    assert advice.evidence["islands"] == ["towers.0", "towers.1", "towers.2"]
    _, fixed = _fit(Towers(), _towers_together(large=True), plugin=_applied(advice.fix))
    assert fixed.history.num_skipped == 0  # measured: the three islands, as printed, in one run
    auto = AmpPlusPrecision("16-mixed", init_scale=1024.0, auto_islands=True)
    _fit(Towers(), _towers_together(large=True), plugin=auto)
    assert auto.history.skipped_steps == [0, 1]  # the first unnamed, the second names all three: none after
    _, quiet = _fit(Towers(), _towers_together(large=False))  # the look-alike: no large feature, no skip
    assert quiet.history.num_skipped == 0


def _tower(k=0):
    """A Linear whose float16 output overflows where feature ``k`` is 100 (1e3 x 100 = 1e5)."""
    tower = nn.Linear(8, 1)
    with torch.no_grad():
        tower.weight.fill_(0.01)
        tower.weight[0, k] = 1e3
        tower.bias.zero_()
    return tower


class TowerThenRouter(LightningModule):
    def __init__(self, graph=True):
        super().__init__()
        self.tower0, self.router, self.graph = _tower(), SentinelRouter(), graph

    def training_step(self, batch, batch_idx):
        x, _ = batch
        overflowed = self.tower0(x).float()
        with torch.set_grad_enabled(self.graph):  # without a graph the loss's cannot tell: not counted either
            gate, _ = self.router(x)  # its +inf sentinel is never used
        return (overflowed.square() * gate[:, :1]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _MaskedScores(nn.Module):
    """Scores x @ w that overflow float16 on their own (1e5), plus an additive mask (0 / -inf), softmaxed."""

    def __init__(self):
        super().__init__()
        w = torch.full((2, 8), 0.01)
        w[:, 1] = 1e3
        self.w = nn.Parameter(w)

    def forward(self, x, bias):
        return (nn.functional.linear(x, self.w) + bias).softmax(-1)


class TowerAndMasked(LightningModule):
    def __init__(self):
        super().__init__()
        self.tower0, self.att = _tower(), _MaskedScores()

    def training_step(self, batch, batch_idx):
        x, _ = batch
        bias = torch.zeros(x.shape[0], 2)
        bias[:, 1] = float("-inf")  # a float32 additive mask, by design
        return (self.tower0(x).float().relu() + self.att(x, bias).float().sum(1, keepdim=True)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _loud(columns):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    x[:, columns] = 100.0
    return DataLoader(TensorDataset(x, torch.zeros(32, 1)), batch_size=4)


@pytest.mark.parametrize("graph", [True, False])
def test_an_unused_sentinel_after_the_first_overflow_is_not_also_born(graph):
    """Break pass on also: a router's +inf sentinel the loss never used, made after the tower overflowed, was listed
    (the next-event rule of first_born does not hold after a birth: the loss's graph alone tells), and auto_islands
    made the router an island for nothing."""
    advisor, plugin = _fit(TowerThenRouter(graph), _loud([0]), steps=3)
    assert [r["origin"] for r in advisor._reporter.skips][1:] == [
        {"phase": "forward", "module": "tower0", "kind": "inf"}
    ] * 2
    assert [a.fix for a in advisor.advice] == [
        'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["tower0"])'
    ]
    auto = AmpPlusPrecision("16-mixed", init_scale=1024.0, auto_islands=True)
    _fit(TowerThenRouter(graph), _loud([0]), plugin=auto, steps=3)
    assert auto._auto.added == ["tower0"]


def test_a_module_that_takes_a_mask_is_not_also_born_and_the_next_run_names_it():
    """Two break passes: a call that took an additive -inf mask and made NaN was listed in also where its scores
    overflowed (a fix that trains), and where a row was all masked (NaN in any precision: a fix that did not). A
    watch cannot tell them apart, so also takes finite inputs and +inf only: the first run names the tower, the
    next the masked scores, and the fix printed then trains."""
    advisor, _ = _fit(TowerAndMasked(), _loud([0, 1]), steps=3)
    assert "also" not in advisor._reporter.skips[1]["origin"]
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower0"]
    advisor, _ = _fit(TowerAndMasked(), _loud([0, 1]), plugin=_applied(advice.fix), steps=3)
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower0", "att"]
    _, fixed = _fit(TowerAndMasked(), _loud([0, 1]), plugin=_applied(advice.fix), steps=3)
    assert fixed.history.num_skipped == 0


class _AllMaskedRow(nn.Module):
    """Finite scores plus an additive mask whose first row is all -inf: NaN there in any precision."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, mask):
        return (self.lin(x) + mask).softmax(-1)


class TowerAndAllMasked(LightningModule):
    def __init__(self):
        super().__init__()
        self.tower0, self.att = _tower(), _AllMaskedRow()

    def training_step(self, batch, batch_idx):
        x, _ = batch
        mask = torch.zeros(x.shape[0], 4)
        mask[0, :] = float("-inf")
        return (self.tower0(x).float().relu() + self.att(x, mask).float().sum(1, keepdim=True)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class TwoAttentions(LightningModule):
    """Two branches share a padding mask with an all-masked row: the same NaN in both, in any precision."""

    def __init__(self):
        super().__init__()
        self.proj, self.attend, self.attend2 = nn.Linear(8, 8), _Attend(), _Attend()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h, mask = self.proj(x), _one_row_all_masked(x)
        return self.attend(h, mask).square().mean() + self.attend2(h, mask).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_the_models_own_nan_beside_a_first_birth_is_never_also_born():
    """Look-alikes from the second break pass: an all-masked row beside an overflowing tower was listed (its island
    did not help); a second attention branch making the island's NaN got fp32_module and, with auto_islands, an
    island that never left. NaN from finite inputs is not also."""
    advisor, _ = _fit(TowerAndAllMasked(), _loud([0]), steps=3)
    assert "also" not in advisor._reporter.skips[1]["origin"]
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower0"]
    loader = DataLoader(TensorDataset(torch.randn(32, 4, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["attend"])
    advisor, _ = _fit(TwoAttentions(), loader, plugin=plugin, steps=3)
    assert _codes(advisor) == ["model_nonfinite"]
    auto = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["attend"], auto_islands=True)
    _fit(TwoAttentions(), loader, plugin=auto, steps=3)
    assert auto._auto.added == []


class _Attend(nn.Module):
    def forward(self, x, mask):
        return (x @ x.transpose(1, 2)).masked_fill(mask, float("-inf")).softmax(-1) @ x


def _one_row_all_masked(x):
    """A padding mask over (batch, 4, 4) scores whose first sample's row 1 is all masked: NaN there in any precision."""
    mask = torch.zeros(x.shape[0], 4, 4, dtype=torch.bool)
    mask[0, 1] = True
    return mask


class AllMaskedAndTower(LightningModule):
    """An all-masked attention row (NaN in any precision) and a tower that overflows float16, in every step."""

    def __init__(self):
        super().__init__()
        self.proj, self.attend, self.tower0 = nn.Linear(8, 8), _Attend(), _tower()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        big = x[:, 0, :].clone()
        big[:, 0] = 100.0
        return (
            self.attend(self.proj(x), _one_row_all_masked(x)).square().mean() + self.tower0(big).float().square().mean()
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_beside_an_island_float32_makes_nan_in_a_module_born_on_its_own_is_named_with_its_island():
    """Break pass on also: where the first birth was a given island that float32 makes NaN in, also was never read,
    so the tower's own overflow in the same steps went untold (model_nonfinite alone; fixing the mask as advised
    still skipped every step). auto_islands adds it too."""
    loader = DataLoader(TensorDataset(torch.randn(32, 4, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["attend"])
    advisor, _ = _fit(AllMaskedAndTower(), loader, plugin=plugin, steps=3)
    assert advisor._reporter.skips[1]["origin"]["also"] == ["tower0"]
    assert _codes(advisor) == ["model_nonfinite", "fp32_module"]
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["attend", "tower0"]
    auto = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["attend"], auto_islands=True)
    _fit(AllMaskedAndTower(), loader, plugin=auto, steps=3)
    assert auto._auto.added == ["tower0"]


class TwoTowers(LightningModule):
    def __init__(self):
        super().__init__()
        self.tower0, self.tower1 = _tower(0), _tower(1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return (self.tower0(x).float() + self.tower1(x).float()).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _first_micro_batch_loud():
    """tower0 overflows in every batch; tower1 only in the even ones: the first micro-batch of each update of two."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 100.0
    for b in range(0, 16, 2):
        x[4 * b : 4 * b + 4, 1] = 100.0
    return DataLoader(TensorDataset(x, torch.zeros(64, 1)), batch_size=4)


def _accumulated(model, plugin, loader):
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=4, accumulate_grad_batches=2).fit(model, loader)
    return advisor, plugin


def test_a_module_born_in_an_earlier_micro_batch_joins_the_origin_and_one_run_prints_the_fix_that_trains():
    """Break pass on also: under accumulation only the last micro-batch was read, so a module that overflows only in
    an earlier one was never named; with the last one's island pasted every update still skipped, told "no rule here
    explains why". The watch's trace of each micro-batch is kept (not its batch) until its update ends."""
    advisor, _ = _accumulated(TwoTowers(), AmpPlusPrecision("16-mixed", init_scale=1024.0), _first_micro_batch_loud())
    assert advisor._reporter.skips[1]["origin"] == {
        "phase": "forward",
        "module": "tower0",
        "kind": "inf",
        "also": ["tower1"],
    }
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower0", "tower1"]
    _, fixed = _accumulated(TwoTowers(), _applied(advice.fix), _first_micro_batch_loud())
    assert fixed.history.skipped_steps == []  # one run, the fix as printed


def test_a_module_that_overflows_only_in_an_earlier_micro_batch_starts_the_watch_and_is_named():
    """Its skips' last micro-batch is finite: told "an earlier micro-batch's loss held them", which never started
    the watch, so no skip of the run was ever named. Now the first starts the watch and the next names the module."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for b in range(0, 16, 2):
        x[4 * b : 4 * b + 4, 1] = 100.0  # tower1's feature, in the first micro-batch of each update only
    loader = DataLoader(TensorDataset(x, torch.zeros(64, 1)), batch_size=4)
    advisor, _ = _accumulated(TwoTowers(), AmpPlusPrecision("16-mixed", init_scale=1024.0), loader)
    assert [r["origin"].get("module") for r in advisor._reporter.skips] == [None, "tower1", "tower1", "tower1"]
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower1"]


def test_a_nan_record_in_an_earlier_micro_batch_is_not_called_forward_and_the_short_run_tells_the_batch():
    """Second break pass: skip_rate said "born before backward (forward)" for a NaN record in an earlier micro-batch
    (its batch is not kept, so nothing there can tell the batch from a forward), and the short run it printed said
    the batch."""

    def data():
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        for b in (2, 6, 10, 14):
            x[4 * b, 3] = float("nan")  # the earlier micro-batch of updates 1, 3, 5, 7
        return DataLoader(TensorDataset(x, torch.zeros(64, 1)), batch_size=4)

    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=8, accumulate_grad_batches=2).fit(TinyModel(), data())
    assert plugin.history.skipped_steps == [1, 3, 5, 7]
    (rate,) = [a for a in advisor.advice if a.code == "skip_rate"]
    assert "4 were born before backward, which no loss scale causes" in rate.message  # no phase claimed
    assert "the batch, your code or the loss" in rate.message
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], max_steps=16).fit(
        TinyModel(), data()
    )  # the short run, as printed
    assert {r["origin"]["phase"] for r in advisor._reporter.skips} == {"input"}


class TwoTowersSometimesNone(TwoTowers):
    def __init__(self, none_at):
        super().__init__()
        self.none_at = none_at

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.none_at else super().training_step(batch, batch_idx)


def _towers_loud(batches, loud, optimizer=None):
    x = torch.randn(4 * batches, 8, generator=torch.Generator().manual_seed(0))
    for b, k in loud.items():
        x[4 * b : 4 * b + 4, k] = 100.0
    return DataLoader(TensorDataset(x, torch.zeros(4 * batches, 1)), batch_size=4)


def test_a_window_that_stepped_no_optimizer_is_not_the_next_updates_and_what_is_kept_is_one_window():
    """Third break pass: a window whose last micro-batch returned None (no step, no update recorded) stayed in the
    reporter's micro-batches, so the next update named tower1, born only in the dropped window (its gradients never
    reached it), and what was kept grew by a window each time. Windows now follow Lightning's (batch_idx % N)."""
    loader = _towers_loud(8, {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 6: 0})  # batch 5 returns None: window 2 steps nothing
    advisor, plugin = _accumulated(TwoTowersSometimesNone({5}), AmpPlusPrecision("16-mixed", init_scale=1024.0), loader)
    assert plugin.history.skipped_steps == [0, 1, 3]
    assert advisor._reporter.skips[-1]["origin"] == {"phase": "forward", "module": "tower0", "kind": "inf"}
    reporter = NaNSkipReporter(find_origin="watch", quiet=True)
    nones = _towers_loud(16, {})
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter], max_steps=16, accumulate_grad_batches=2
    )
    trainer.fit(TwoTowersSometimesNone(set(range(1, 16, 2))), nones)  # every window's last micro-batch: None
    assert len(reporter._window) + len(reporter._last_window) <= 2  # one micro-batch a window here, two windows


class _AttendOrTower(LightningModule):
    """First micro-batch: an all-masked attention row (NaN in any precision); last: the tower overflows float16."""

    def __init__(self):
        super().__init__()
        self.proj, self.attend, self.tower0 = nn.Linear(8, 8), _Attend(), _tower()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        mask = torch.zeros(x.shape[0], 4, 4, dtype=torch.bool)
        big = x[:, 0, :].clone()
        if batch_idx % 2 == 0:
            mask[0, 1] = True
        else:
            big[:, 0] = 100.0
        return self.attend(self.proj(x), mask).square().mean() + self.tower0(big).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_an_earlier_micro_batchs_own_nan_does_not_join_also():
    """Third break pass: an earlier micro-batch's module joined also whatever it made; the all-masked row's NaN got
    an island that did not help. Joining follows also's rule (+inf only)."""
    loader = DataLoader(TensorDataset(torch.randn(64, 4, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)
    advisor, _ = _accumulated(_AttendOrTower(), AmpPlusPrecision("16-mixed", init_scale=1024.0), loader)
    assert all("also" not in r["origin"] for r in advisor._reporter.skips if r["origin"])
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["tower0"]


def test_a_fused_skip_read_after_the_next_window_began_is_told_from_its_own_window(monkeypatch):
    """Third break pass: a fused optimizer's flag read late (a busy GPU: simulated) took the next window's
    micro-batches as its own: update 1's tower1 was put on update 0, and update 1 lost its origin."""
    from lightning_amp_plus import syncs

    value = syncs.FlagPeek.value

    def late(self, wait=False):  # the first polls say "not yet", as a busy device's event does
        self._polls = getattr(self, "_polls", 0) + 1
        return None if not wait and self._polls <= 4 else value(self, wait=True)

    monkeypatch.setattr(syncs.FlagPeek, "value", late)

    class Fused(TwoTowers):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0, fused=True)

    reporter = NaNSkipReporter(find_origin="watch", quiet=True)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0)
    trainer = make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=4, accumulate_grad_batches=4)
    trainer.fit(Fused(), _towers_loud(16, {3: 0, 4: 1}))
    assert [(r["step"], r["origin"]) for r in reporter.skips] == [
        (0, {"phase": "forward", "module": "tower0", "kind": "inf"}),
        (1, {"phase": "forward", "module": "tower1", "kind": "inf"}),
    ]


def test_an_accumulated_skip_whose_every_loss_was_finite_is_born_in_backward():
    """Every micro-batch's loss is kept now: all finite, the gradients overflowed in backward (was: no origin)."""
    reporter = NaNSkipReporter(quiet=True)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**24)  # a scale that overflows the gradients
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=2, accumulate_grad_batches=2).fit(TinyModel())
    assert plugin.history.skipped_steps
    assert {r["origin"]["phase"] for r in reporter.skips} == {"backward"}


class LoudFirstMicroBatch(TinyModel):
    """Your own code overflows float16 in the first micro-batch of each update of two (6e4 * 2 in half precision)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if batch_idx % 2 == 0:
            out = out + torch.full_like(out, 6e4, dtype=torch.float16) * 2
        return nn.functional.mse_loss(out.float(), y)


def test_skips_born_in_an_earlier_micro_batch_where_no_module_is_named_are_said_with_the_run_that_tells_where():
    """No module to name there (your code): skip_rate said "before the watch named a module" and printed the
    reporter the run had. It says where they were born and prints the short run that tells; that run, as printed,
    tells it (after the last module call)."""
    advisor, plugin = _accumulated(LoudFirstMicroBatch(), AmpPlusPrecision("16-mixed", init_scale=1024.0), None)
    assert plugin.history.skipped_steps == [0, 1, 2, 3]
    (rate,) = [a for a in advisor.advice if a.code == "skip_rate"]
    assert "4 in an earlier micro-batch of their update, where no module was named" in rate.message
    assert rate.fix.startswith("Trainer(accumulate_grad_batches=1)")
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], max_steps=8).fit(
        LoudFirstMicroBatch()
    )
    # told: after the last module call (your code there, or the loss function), with nonfinite_loss's fix
    assert {r["origin"]["phase"] for r in advisor._reporter.skips[1:]} == {"loss"}
    assert "nonfinite_loss" in _codes(advisor)


# ------------------------------------------------------------------------------------- a scale too low, no reference
class Faint(TinyModel):
    """A loss x 1e-7: every gradient 1e-7 of its size, most below float16's normal range at a scale of 2**11."""

    def __init__(self, factor):
        super().__init__(optimizer="fused_sgd", lr=1e-3)
        self.factor = factor

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.factor


def _faint(factor, plugin):
    torch.manual_seed(0)
    monitor = GradUnderflowMonitor(every_n_steps=3)
    advisor, _ = _fit(Faint(factor), plugin=plugin, callbacks=[monitor], steps=40)
    return advisor, monitor


def test_a_scale_too_low_is_told_with_the_scale_the_headroom_allows_and_the_fix_helps():
    advisor, monitor = _faint(1e-7, AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=100))
    lost = [m["underflow_fraction"] for m in monitor.measurements]
    assert len(lost) == 13
    assert min(lost) > 0.5
    (advice,) = [a for a in advisor.advice if a.code == "init_scale"]
    assert "healthy" not in advisor.format()
    _, fixed = _faint(1e-7, _applied(advice.fix))
    assert max(m["underflow_fraction"] for m in fixed.measurements) < 0.5 * min(lost)  # measured: it helps
    healthy, quiet = _faint(1.0, AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=100))
    assert "init_scale" not in _codes(healthy)  # the look-alike: the same run at its own loss


def test_a_scale_pinned_at_its_cap_gets_a_fix_that_helps_within_the_run_and_advise_tells_it_too(tmp_path, capsys):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_amp_plus import LossScaleMonitor
    from lightning_amp_plus.__main__ import main

    def pinned(plugin, logger=False):
        torch.manual_seed(0)
        monitor = GradUnderflowMonitor(every_n_steps=3)
        advisor = AmpAdvisor(print_advice=False)
        callbacks = [advisor, monitor, *([LossScaleMonitor()] if logger else [])]
        make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=40, logger=logger, log_every_n_steps=3).fit(
            Faint(1e-7)
        )
        return advisor, monitor

    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12, max_scale=2.0**12, growth_interval=100)
    advisor, monitor = pinned(plugin, logger)
    (advice,) = [a for a in advisor.advice if a.code == "max_scale"]
    lost = [m["underflow_fraction"] for m in monitor.measurements]
    _, fixed = pinned(_applied(advice.fix))
    assert max(m["underflow_fraction"] for m in fixed.measurements) < 0.5 * min(lost)  # within the same 40 steps
    capsys.readouterr()
    assert main(["advise", logger.log_dir]) == 0
    out = capsys.readouterr().out
    assert "[max_scale]" in out  # the logged call's cap, read offline: not "init_scale ... too low"
    assert f"    fix: {advice.fix}\n" in out


# ------------------------------------------------------------------------------------------ -inf made in float16
class Scores(nn.Module):
    """Causal attention scores masked with -inf in float16 (nanoGPT's `masked_fill`): by design, no overflow."""

    def forward(self, q, k):
        s = q @ k.transpose(-1, -2) / 4.0
        causal = torch.triu(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool), 1)
        return s.masked_fill(causal, float("-inf"))


class Loud(nn.Module):
    """A Linear whose output is multiplied by 1e6 on the batches holding a large value: it overflows float16."""

    def __init__(self, out=16):
        super().__init__()
        self.fc = nn.Linear(16, out)
        self.loud = False

    def forward(self, x):
        return self.fc(x) * (1e6 if self.loud else 1.0)


class MaskedThenLoud(TinyModel):
    """Float16 -inf made on purpose (masked scores, or a -inf bias banning classes), then a real overflow in `big`."""

    def __init__(self, bias):
        super().__init__(lr=1e-3)
        self.bias = bias
        self.emb, self.qkv, self.scores = nn.Linear(8, 16), nn.Linear(16, 48), Scores()
        self.cls = nn.Linear(16, 10)
        with torch.no_grad():
            self.cls.bias[7:] = float("-inf")  # classes 7-9 banned
        self.cls.bias.requires_grad_(False)
        self.big, self.head = Loud(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        if self.bias:
            loss = self.cls(h).float()[..., :7].logsumexp(-1).mean() * 0  # its -inf columns left out
        else:
            q, k, v = self.qkv(h).split(16, -1)
            h = torch.softmax(self.scores(q, k).float(), -1).to(v.dtype) @ v
            loss = 0
        self.big.loud = bool(x.abs().max() > 100)
        return loss + nn.functional.mse_loss(self.head(self.big(h)).float().mean(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _loud_at(steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, 8, generator=g)
    for step in steps:
        x[4 * step, 0, 0] = 1000.0
    return DataLoader(TensorDataset(x, torch.randn(40, 1, generator=g)), batch_size=4)


@pytest.mark.parametrize("bias", [False, True], ids=["masked scores", "-inf bias"])
def test_minus_inf_made_in_float16_on_purpose_is_no_overflow_the_later_one_is_named(bias):
    for find_origin in (True, "replay"):
        reporter = NaNSkipReporter(find_origin=find_origin, quiet=True)
        _, plugin = _fit(MaskedThenLoud(bias), _loud_at((1, 4, 7)), callbacks=[reporter], steps=10)
        assert plugin.history.skipped_steps == [1, 4, 7]
        told = [r["origin"] for r in reporter.skips][0 if find_origin == "replay" else 1 :]  # the first starts it
        assert [(o["phase"], o["module"]) for o in told] == [("forward", "big")] * len(told), find_origin


class _HandBCE(LightningModule):
    """A hand-written BCE on float16 sigmoid outputs; logits of 20 saturate float16's sigmoid at 1 (log(1 - p) = -inf).

    ``fixed``: the loss line the advice prints, as printed.
    """

    def __init__(self, fixed=False, eps=0.0):
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.fixed, self.eps = fixed, eps
        with torch.no_grad():
            self.net.weight.zero_()
            self.net.bias.fill_(20.0)

    def training_step(self, batch, batch_idx):
        x, target = batch
        logits = self.net(x)
        if self.fixed:
            return torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target.float())
        p = torch.sigmoid(logits)
        if self.eps:  # the common guard, which float16 rounds away (1e-8 is 0 there)
            return -(target * torch.log(p + self.eps) + (1 - target) * torch.log(1 - p + self.eps)).float().mean()
        return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x, y = torch.randn(32, 8), (torch.arange(32) % 2).float().unsqueeze(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_a_loss_that_takes_the_log_of_a_saturated_float16_sigmoid_is_named_and_its_printed_loss_line_trains(eps):
    """``eps``: `log(p + 1e-8)`, the usual guard, is named too (break pass on issue 54: it got the template fix)."""
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, max_warnings=0)
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, min_scale=0.0)
    make_trainer(plugins=[plugin], callbacks=[reporter, advisor], max_steps=4).fit(_HandBCE(eps=eps))
    assert [(r["origin"]["phase"], r["origin"].get("op")) for r in reporter.skips] == [("loss", "log(sigmoid)")] * 4
    from lightning_amp_plus.callbacks._skip_text import describe_origin

    assert describe_origin(reporter.skips[1]["origin"]) == (  # the skip line's words
        "born in the loss (every watched module output was finite; it takes the log(sigmoid) of float16 values)"
    )
    (advice,) = [a for a in advisor.advice if a.code == "nonfinite_loss"]
    assert "its code takes the log(sigmoid) of float16 values" in advice.message
    assert advice.fix.startswith(
        "loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target.float())"
    )
    fixed = AmpPlusPrecision("16-mixed", init_scale=2.0**10, min_scale=0.0)
    make_trainer(plugins=[fixed], max_steps=4).fit(_HandBCE(fixed=True))  # the printed line, in the step
    assert fixed.history.skipped_steps == []


class _ScaledInPlace(TinyModel):
    """The step's own code scales the last module's output in place after it returned (`h.mul_`): float16 overflows
    there, with every module output finite. ``fixed``: the printed fix applied (the output in float32 first)."""

    def __init__(self, fixed=False):
        super().__init__(lr=0.0)
        self.fixed = fixed

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        if self.fixed:  # loss_fn(logits.float(), target), logits the last module's output before the code touches it
            h = h.float()
        h.mul_(1e6)
        return nn.functional.mse_loss(h.float(), y) * 1e-12


def test_own_code_after_the_last_module_call_is_said_and_the_printed_fix_as_applied_trains():
    """Issue 52.5: told "loss" with a fix at the loss call that did not help. The line now says where it was born
    (after the last module call: your code or the loss function), and its fix casts the module's output first."""
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, max_warnings=0)
    advisor, plugin = _fit(_ScaledInPlace(), callbacks=[reporter], steps=4)
    assert plugin.history.num_skipped == 4
    assert {r["origin"]["phase"] for r in reporter.skips} == {"loss"}
    (advice,) = [a for a in advisor.advice if a.code == "nonfinite_loss"]
    assert "born after the last module call: in your code after it, or in the loss function" in advice.message
    assert "the last module's output, in float32 before your code" in advice.fix
    _, fixed = _fit(_ScaledInPlace(fixed=True), steps=4)
    assert fixed.history.num_skipped == 0
