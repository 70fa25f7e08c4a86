"""Where in backward: `NaNSkipReporter(backward_origin=True)` reruns a skipped step, sandboxed, and names the op and
module whose backward made the gradient non-finite from a finite one, and whether float32 makes it too.

By default nothing reruns the step: a run that skips in backward at the scale floor is told only that nothing it
measured separates float16's range from a backward that makes NaN itself (`backward_skips`), and its fix is the opt-in
rerun; with it, `model_nonfinite` (a NaN of the model's own, the op's guard as the fix) or `bf16` (float16's range).
Each fix is applied as printed and measured.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Pairs(TinyModel):
    """A distance loss over pairs: `sqrt` of a squared distance that is 0 on duplicate pairs (NaN in backward, in
    float32 too: sqrt's gradient at 0 is inf, times a zero difference)."""

    def __init__(self, guard=False):
        super().__init__(optimizer="fused_sgd", lr=1e-3)
        self.embed = nn.Linear(8, 8)
        self.guard = guard

    def training_step(self, batch, batch_idx):
        (x,) = batch
        z = self.embed(x).float()
        squared = (z[0::2] - z[1::2]).pow(2).sum(-1)
        distance = squared.clamp_min(1e-12).sqrt() if self.guard else squared.sqrt()
        return nn.functional.relu(1.0 - distance).mean()


def _pairs_loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    x[1::8] = x[0::8]  # every fourth pair is a duplicate
    return DataLoader(TensorDataset(x), batch_size=8)


def _fit(model, loader=None, callbacks=(), plugin=None, steps=8, collapses=False):
    """A run at the scale floor (where the reporter's own collapse check stops it: then the error is asserted)."""
    advisor = AmpAdvisor(print_advice=False)
    plugin = plugin or AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    trainer = make_trainer(plugins=[plugin], callbacks=[advisor, *callbacks], max_steps=steps)
    if collapses:
        with pytest.raises(LossScaleCollapseError) as error:
            trainer.fit(model, loader)
        advisor.error = str(error.value)
    else:
        trainer.fit(model, loader)
    return advisor, plugin


def _codes(advisor):
    return [a.code for a in advisor.advice]


def test_a_nan_the_loss_makes_in_backward_is_the_models_own_and_its_guard_fixes_it():
    advisor, plugin = _fit(Pairs(), _pairs_loader())
    assert plugin.history.num_skipped == 8
    assert _codes(advisor) == ["backward_skips"]  # no rerun by default: range or the model's own, not told which
    (advice,) = advisor.advice
    assert "bf16" not in advice.fix  # the bf16 the old reading printed left these skips as they were
    reporter = eval(advice.fix.split("  #")[0], {"NaNSkipReporter": NaNSkipReporter})  # pasted as printed
    # at the floor its collapse check stops the run at the first skip, and says what the advisor says
    told, _ = _fit(Pairs(), _pairs_loader(), callbacks=[reporter], collapses=True)
    origin = reporter.skips[0]["origin"]
    assert origin == {
        "phase": "backward",
        "module": "",  # the loss, in training_step
        "op": "SqrtBackward0",
        "kind": "inf",  # sqrt's gradient at 0; times the zero difference it becomes nan further on
        "float32": "nonfinite",
    }
    assert _codes(told) == ["model_nonfinite"]
    (model_advice,) = told.advice
    assert model_advice.fix == "torch.sqrt(x.clamp_min(1e-12))  # sqrt's gradient at 0 is inf"
    assert f"HINT: {model_advice.fix}" in told.error  # the collapse error's hint is the same reading
    _, guarded = _fit(Pairs(guard=True), _pairs_loader())  # the guard the fix names, applied
    assert guarded.history.num_skipped == 0
    _, bf16 = _fit(Pairs(), _pairs_loader(), plugin=AmpPlusPrecision("bf16-mixed"))
    assert bf16.history.num_skipped == 8  # and the precision fix the old reading printed: no help


class Huge(TinyModel):
    """Gradients beyond float16's range even unscaled: the loss times 1e7 (finite in float32)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e7


def test_an_fp16_overflow_in_backward_is_float16s_range_and_bf16_fixes_it():
    reporter = NaNSkipReporter(backward_origin=True, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=4.0, min_scale=1.0)
    advisor, plugin = _fit(Huge(optimizer="fused_sgd", lr=1e-12), callbacks=[reporter], plugin=plugin, collapses=True)
    assert plugin.history.num_skipped >= 3  # 4, 2, then 1: at the floor the reporter stops it
    origin = reporter.skips[0]["origin"]
    assert origin["phase"] == "backward"
    assert origin["float32"] == "finite"  # float16's range: finite in float32
    assert origin["kind"] == "inf"
    assert _codes(advisor) == ["bf16"]
    (advice,) = advisor.advice
    assert "a rerun found the gradients finite in float32" in advice.message
    fixed = eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})
    _, fixed_plugin = _fit(Huge(optimizer="fused_sgd", lr=1e-12), plugin=fixed, steps=6)
    assert fixed_plugin.history.num_skipped == 0


class _NanGrad(torch.autograd.Function):
    """Identity forward; a backward that makes NaN wherever its input is 0 (a custom op's bug, any precision)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x * x  # 0/0 where x is 0


class Block(nn.Module):
    """A transformer block whose feed-forward runs a custom op with a broken backward."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        h = self.norm(x + self.attn(x, x, x, need_weights=False)[0])
        return h + _NanGrad.apply(self.ff(h))


class WithBlock(TinyModel):
    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=1e-3)
        self.block = Block()
        with torch.no_grad():
            self.block.ff[2].bias.zero_()
            self.block.ff[2].weight[0].zero_()  # feature 0 of the custom op's input is exactly 0

    def forward(self, x):
        return self.net(self.block(x.reshape(x.shape[0], 1, 8)).reshape(x.shape[0], 8))


def test_a_nan_a_custom_backward_makes_inside_a_transformer_block_is_named_with_its_module():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    advisor, plugin = _fit(WithBlock(), callbacks=[reporter], plugin=plugin, steps=4)
    assert plugin.history.num_skipped == 4
    assert reporter.skips[0]["origin"] == {
        "phase": "backward",
        "module": "block",  # the custom op runs in the block's own forward code
        "op": "_NanGradBackward",
        "kind": "nan",
        "float32": "nonfinite",
    }
    (advice,) = [a for a in advisor.advice if a.code == "model_nonfinite"]
    assert "in the backward of block (_NanGradBackward)" in advice.message
    assert "bf16" not in [a.code for a in advisor.advice]


class CosineAttention(nn.Module):
    """q normalised by `q / (sqrt(sum q^2) + eps)` (eps outside the sqrt); its output is its child's (`self.o(...)`),
    as every attention with an output projection returns."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x)
        return self.o(q / (q.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6))


class WithCosine(TinyModel):
    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=1e-3)
        self.attn = CosineAttention()

    def forward(self, x):
        return self.net(self.attn(x * (torch.arange(x.shape[0], device=x.device) % 2)[:, None]))  # even rows: 0


def test_a_module_that_returns_its_childs_output_owns_the_code_between():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    _, plugin = _fit(WithCosine(), callbacks=[reporter], plugin=plugin, steps=2)
    assert plugin.history.num_skipped == 2
    origin = reporter.skips[0]["origin"]
    assert (origin["module"], origin["op"], origin["float32"]) == ("attn", "SqrtBackward0", "nonfinite")  # not ""


def test_the_rerun_leaves_the_run_bit_identical():
    def run(backward_origin):
        torch.manual_seed(0)
        model = Pairs()
        reporter = NaNSkipReporter(backward_origin=backward_origin, max_consecutive_skips=None, max_warnings=0)
        plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=8).fit(model, _pairs_loader())
        return model, reporter

    told, reporter = run(True)
    plain, _ = run(False)
    assert reporter.skips[0]["origin"]["op"] == "SqrtBackward0"
    for (name, a), (_, b) in zip(told.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_backward_origin_is_refused_nowhere_but_never_reruns_a_manual_step():
    class Manual(Pairs):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            loss = super().training_step(batch, batch_idx)
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    model = Manual()
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, max_warnings=0)
    _fit(model, _pairs_loader(), callbacks=[reporter], plugin=AmpPlusPrecision("16-mixed", min_scale=0.0))
    assert model.steps == 8  # it steps optimizers itself: never run again
    assert all(r["origin"] == {"phase": "backward"} for r in reporter.skips)


@pytest.mark.parametrize("value", [1, "yes"])
def test_backward_origin_takes_a_bool(value):
    with pytest.raises(TypeError, match="backward_origin"):
        NaNSkipReporter(backward_origin=value)
