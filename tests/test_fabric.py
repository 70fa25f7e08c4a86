"""Fabric: the same engine, scaler, history and skip reporting as the Trainer plugin."""

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_amp_plus import AmpPlusFabricPrecision, NaNSkipReporter
from tests.helpers.models import make_loader


def _setup(plugin, fused=False):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    fmodel, fopt = fabric.setup(model, opt)
    return fabric, model, fmodel, fopt


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_skip_clip_and_history(fused):
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    fabric, model, fmodel, fopt = _setup(plugin, fused=fused)
    reporter = NaNSkipReporter(max_warnings=0, sync_fused=fused)
    reporter.attach(plugin, model)
    norms = []
    for step, (x, y) in enumerate(make_loader()):
        if step == 8:
            break
        out = fmodel(x)
        assert out.dtype == torch.float32  # convert_output, as Fabric's own MixedPrecision
        loss = nn.functional.mse_loss(out, y)
        if step == 2:
            loss = loss * float("inf")
        fabric.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        norms.append(float(fabric.clip_gradients(fmodel, fopt, max_norm=0.05, error_if_nonfinite=False)))
        fopt.step()
        fopt.zero_grad()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == (step == 2)
    assert plugin.history.skipped_steps == [2]
    assert plugin.history.curve() == [(0, 1024.0), (3, 512.0), (6, 1024.0)]
    assert all(n < 100 for i, n in enumerate(norms) if i != 2)  # true norms before clipping
    assert [r["step"] for r in reporter.skips] == [2]
    assert reporter.skips[0]["offenders"]
    reporter.finish()


def test_manual_update_backs_off_once_for_two_optimizers():
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=256.0, update="manual")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    a, b = nn.Linear(8, 1), nn.Linear(8, 1)
    a, opt_a = fabric.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
    b, opt_b = fabric.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
    x, y = next(iter(make_loader()))
    loss = nn.functional.mse_loss(a(x) + b(x), y)
    handle = a.weight.register_hook(lambda g: g * float("inf"))
    fabric.backward(loss)
    handle.remove()
    scaled = b.weight.grad.detach().clone()
    before = b.weight.detach().clone()
    opt_a.step()
    opt_b.step()
    plugin.update()
    assert plugin.loss_scale == 128.0
    torch.testing.assert_close(b.weight.detach() - before, -0.1 * scaled / 256.0, rtol=1e-3, atol=1e-7)
    assert plugin.history.skipped_steps == [0]
    assert plugin.history.num_steps == 1


def test_bf16_and_state_dict():
    plugin = AmpPlusFabricPrecision("bf16-mixed")
    fabric, model, fmodel, fopt = _setup(plugin)
    x, y = next(iter(make_loader()))
    fabric.backward(nn.functional.mse_loss(fmodel(x), y) * float("nan"))
    fopt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.optimizer_step_was_skipped
    clone = AmpPlusFabricPrecision("bf16-mixed")
    clone.load_state_dict(plugin.state_dict())
    assert clone.history.skipped_steps == [0]


def test_bad_arguments():
    with pytest.raises(
        ValueError,
        match=r"^`AmpPlusFabricPrecision\(update='sometimes'\)` is invalid: expected one of 'step', 'manual'\.$",
    ):
        AmpPlusFabricPrecision(update="sometimes")
    with pytest.raises(ValueError, match=r"`AmpPlusFabricPrecision\(precision='bf16-mixed', hysteresis=2\)`"):
        AmpPlusFabricPrecision("bf16-mixed", hysteresis=2)


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_the_dtypes_the_model_receives_computes_and_returns(precision, dtype):
    """Fabric's adapter: floating inputs arrive in the autocast dtype, integers as they are; the matmul runs in
    that dtype; the output comes back in the default dtype."""
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, ids):
            out = self.lin(x.float())
            seen.update(x=x.dtype, ids=ids.dtype, out=out.dtype)
            return out

    plugin = AmpPlusFabricPrecision(precision)
    assert plugin.precision == precision
    assert plugin.device == "cpu"
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(Probe())
    result = model(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, dtype=torch.long))
    assert seen == {"x": dtype, "ids": torch.int64, "out": dtype}
    assert result.dtype == torch.float32


def test_fabric_plugin_defaults_arguments_and_repr():
    plugin = AmpPlusFabricPrecision()
    assert plugin.precision == "16-mixed"
    assert plugin.engine.warn_skip_streak == 50
    assert repr(plugin) == "AmpPlusFabricPrecision()"
    plugin = AmpPlusFabricPrecision("bf16-mixed", "cpu", warn_skip_streak=3, update="manual")
    assert plugin.engine.warn_skip_streak == 3
    assert (
        repr(plugin)
        == "AmpPlusFabricPrecision(precision='bf16-mixed', device='cpu', warn_skip_streak=3, update='manual')"
    )


def _fabric_setup(precision):
    plugin = AmpPlusFabricPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Linear(4, 1))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    return plugin, model, opt


def test_bf16_steps_after_a_direct_loss_backward_as_stock_does():
    plugin, model, opt = _fabric_setup("bf16-mixed")
    x = torch.randn(8, 4)
    model.module(x).float().pow(2).mean().backward()  # not fabric.backward: bf16 scales nothing, so it may
    expected = [p.detach() - 0.1 * p.grad for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected, strict=True))
    opt.zero_grad()
    (model.module(x).float().pow(2).mean() * float("nan")).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # still checked
    assert plugin.history.skipped_steps == [1]


def test_16_mixed_says_what_to_call_after_a_direct_loss_backward():
    _, model, opt = _fabric_setup("16-mixed")
    model.module(torch.randn(8, 4)).float().pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"found no scaled loss.*HINT: call `fabric.backward\(loss\)`"):
        opt.step()


def test_16_mixed_refuses_lbfgs_with_the_trainer_plugins_message():
    """One refusal for both adapters: the same error type and words as `AmpPlusPrecision` at connect."""
    plugin = AmpPlusFabricPrecision("16-mixed", "cpu")
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"AmpPlusFabricPrecision\(precision='16-mixed'\)` cannot train with `torch\.optim\.LBFGS`.*HINT",
    ):
        plugin.optimizer_step(torch.optim.LBFGS(model.parameters()), closure=lambda: model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight, before)


def test_fabric_plugin_repr_names_the_scaler_in_use_not_the_grad_scaler_given():
    """Issue 53: a one-line change (repr of the GradScaler given) left the suite green."""
    given = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    plugin = AmpPlusFabricPrecision(scaler=given)
    assert plugin.scaler is not given  # taken into the package's own scaler
    assert repr(plugin) == f"AmpPlusFabricPrecision(scaler={plugin.scaler!r})"
    assert "DynamicLossScaler(" in repr(plugin)
    assert "growth_interval=7" in repr(plugin)
    assert "GradScaler object" not in repr(plugin)
