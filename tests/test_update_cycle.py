"""One update cycle, one skip decision: the edges (wrappers, closures, accumulation, GANs, reuse, failures)."""

from __future__ import annotations

import csv
import logging
import warnings
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_amp_plus import (
    AmpPlusFabricPrecision,
    AmpPlusFSDPPrecision,
    AmpPlusPrecision,
    AmpPlusWarning,
    DynamicLossScaler,
    LossScaleCollapseError,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
    ScaleHistory,
)
from lightning_amp_plus.__main__ import main as cli
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import StepProbe, make_trainer

LR = 0.1


def _rows(path: Any) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------ 3: a user's optimizer wrapper
class Lookahead(torch.optim.Optimizer):
    """A user's wrapper that keeps its inner optimizer in `_optimizer`, as Lookahead implementations do."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self._optimizer = inner
        self.steps = 0

    @property
    def param_groups(self):  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self._optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return self._optimizer.step(closure)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)


class WrappedOptimizerModel(TinyModel):
    def configure_optimizers(self) -> Any:
        self.wrapper = Lookahead(torch.optim.SGD(self.parameters(), lr=self.lr))
        return self.wrapper


def test_a_users_wrapper_is_an_optimizer_whose_own_step_runs():
    model = WrappedOptimizerModel(grad_poison={2: "net.0.weight"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    probe = StepProbe()
    make_trainer(plugins=[plugin], callbacks=[probe], max_steps=6).fit(model)
    assert model.wrapper.steps == 5  # every clean step went through the wrapper (stock: 6, skips included)
    assert probe.unchanged == [2]
    assert plugin.history.skipped_steps == [2]


def test_the_scaler_steps_a_users_wrapper_and_resolves_lightnings():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = nn.Linear(4, 1)
    wrapper = Lookahead(torch.optim.SGD(model.parameters(), lr=LR))
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(wrapper)
        scaler.update()
    assert wrapper.steps == 3
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(LightningOptimizer(inner))
    assert scaler.is_unscaled(inner)  # Lightning's wrapper and its optimizer are one identity


# ------------------------------------------------------------------------------- 4 and 6: closure optimizers (bf16)
def _lbfgs_fabric(poison_at: set[int]):
    plugin = AmpPlusFabricPrecision("bf16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    fmodel, fopt = fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3))
    return plugin, fabric, model, fmodel, fopt


def test_fabric_bf16_closure_nan_is_checked_after_the_closure_and_undone():
    plugin, fabric, model, fmodel, fopt = _lbfgs_fabric({1})
    x, y = next(iter(make_loader()))
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            fopt.zero_grad()
            loss = nn.functional.mse_loss(fmodel(x).float(), y)
            if step == 1:
                loss = loss * float("nan")
            fabric.backward(loss)
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        state_before = {k: repr(v) for k, v in fopt.state_dict()["state"].items()}
        fopt.step(closure)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == (step == 1)
        if step == 1:  # the optimizer's state too: bit-identical
            assert {k: repr(v) for k, v in fopt.state_dict()["state"].items()} == state_before
    assert plugin.history.skipped_steps == [1]
    assert plugin.history.num_steps == 3


def test_trainer_bf16_trains_lbfgs_like_stock_and_skips_a_nan():
    def run(plugin: Any, poison: dict[int, str]) -> tuple[TinyModel, Any]:
        torch.manual_seed(0)
        model = TinyModel(optimizer="lbfgs", lr=0.5, poison=poison)
        make_trainer(plugins=[plugin], max_steps=4, gradient_clip_val=1.0).fit(model)
        return model, plugin

    ours, plugin = run(AmpPlusPrecision("bf16-mixed"), {})
    stock, _ = run(MixedPrecision("bf16-mixed", "cpu"), {})
    assert ours.losses == stock.losses  # stock bf16 trains LBFGS; so do we, bit for bit
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plugin.history.num_steps == 4

    probe = _DeepProbe()
    torch.manual_seed(0)
    model = TinyModel(optimizer="lbfgs", lr=0.5, poison={2: "nan"})
    plugin = AmpPlusPrecision("bf16-mixed")
    make_trainer(plugins=[plugin], callbacks=[probe], max_steps=4).fit(model)
    assert probe.unchanged == [2]  # parameters and LBFGS's whole state (lists of tensors included) bit-identical
    assert plugin.history.skipped_steps == [2]


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for k in sorted(value, key=str) for x in (k, *_flat(value[k]))]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value.detach().clone() if isinstance(value, torch.Tensor) else value]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


class _DeepProbe(Callback):
    """Which batches left the parameters and the optimizer's whole state unchanged."""

    def __init__(self) -> None:
        self.unchanged: list[int] = []

    def _snap(self, trainer: Any, module: Any) -> list[Any]:
        opt = trainer.optimizers[0]
        return _flat([list(module.parameters()), [opt.state[p] for p in module.parameters() if p in opt.state]])

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._before = self._snap(trainer, module)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if _same(self._before, self._snap(trainer, module)):
            self.unchanged.append(batch_idx)


# ---------------------------------------------------------------------------- 5: accumulation across a scale change
class AccumulatingB(LightningModule):
    """opt_a steps every batch; opt_b accumulates over 2 batches. The scale grows after every clean update."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)
        self.pending: list[torch.Tensor] = []  # b's true gradient of each batch since its last step
        self.checks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (applied delta, -lr * sum of true grads)
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y)
        scale = self.trainer.precision_plugin.loss_scale
        self.scales.append(scale)
        before_grad = self.b.weight.grad.detach().clone() if self.b.weight.grad is not None else 0.0
        self.manual_backward(loss)
        self.pending.append((self.b.weight.grad.detach() - before_grad) / scale)  # scale: a power of 2, exact
        opt_a.step()
        opt_a.zero_grad()
        if batch_idx % 2 == 1:
            before = self.b.weight.detach().clone()
            opt_b.step()
            self.checks.append((self.b.weight.detach() - before, -LR * sum(self.pending)))
            opt_b.zero_grad()
            self.pending = []

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.a.parameters(), lr=LR), torch.optim.SGD(self.b.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        return make_loader()


def test_gradients_accumulated_across_a_scale_change_apply_exactly():
    model = AccumulatingB()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    make_trainer(plugins=[plugin], max_steps=12).fit(model)  # 8 batches: a steps 8 times, b 4 times
    assert model.scales[:4] == [2.0**8, 2.0**9, 2.0**10, 2.0**11]  # a new scale for every batch
    assert len(model.checks) == 4
    for applied, expected in model.checks:
        torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------- 7: consecutive means consecutive updates
class FusedGAN(LightningModule):
    """Two fused optimizers stepping in every batch; every loss (or the chosen batches') overflows."""

    def __init__(self, poison: Any = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1)
        self.poison = poison
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, y = batch
        bad = self.poison is None or batch_idx in self.poison
        for opt, loss in ((opt_d, self.d(x)), (opt_g, self.d(self.g(x)))):
            loss = nn.functional.mse_loss(loss.float(), y) * (float("inf") if bad else 1.0)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("g_loss", 1.0)
        self.batches += 1

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.g.parameters(), lr=LR, fused=True),
            torch.optim.SGD(self.d.parameters(), lr=LR, fused=True),
        )

    def train_dataloader(self) -> Any:
        return make_loader(n=256)


def test_fused_gan_collapse_is_raised_after_five_consecutive_updates():
    model = FusedGAN()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, min_scale=0.0)
    reporter = NaNSkipReporter(max_consecutive_skips=5, max_warnings=0)
    with pytest.raises(LossScaleCollapseError, match=r"5 consecutive optimizer steps were skipped"):
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=120, log_every_n_steps=1).fit(model)
    assert model.batches == 5  # stock of 0.1.x: never raised, 60 of 60 updates skipped
    assert [r["step"] for r in reporter.skips] == [0, 1, 2, 3, 4]  # logger steps: one per batch
    assert plugin.history.streak_at(4) == 5


def test_fused_skips_with_a_clean_update_between_are_not_consecutive():
    model = FusedGAN(poison={0, 1, 3, 4, 6, 7})
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, min_scale=0.0)
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=18, log_every_n_steps=1).fit(model)
    history = plugin.history
    assert history.skipped_steps == [0, 1, 3, 4, 6, 7]
    assert [history.streak_at(s) for s in history.skipped_steps] == [1, 2, 1, 2, 1, 2]
    assert reporter.num_skips == 6


# ----------------------------------------------------------------------- 8: a fit that raises leaves nothing behind
class Boom(TinyModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.raise_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_failed_fit_detaches_callbacks_and_removes_hooks_then_a_retry_trains(tmp_path):
    model = Boom(poison={0: "inf"})
    model.raise_at = 0
    plugin = AmpPlusPrecision("16-mixed", init_scale=4.0, min_scale=1.0)
    callbacks = [PrecisionReport(print_table=False), NaNSkipReporter(max_consecutive_skips=1), LossScaleMonitor()]
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=4, logger=CSVLogger(tmp_path)).fit(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert plugin.listeners == ()
    # the same plugin, no callbacks: skips in a row are only skips (the old reporter would raise on the first)
    model.raise_at = -1
    model.poison = {0: "inf", 1: "inf", 2: "inf"}
    make_trainer(plugins=[plugin], max_steps=6).fit(model)
    assert plugin.history.skipped_steps == [0, 1, 2]
    assert plugin.history.num_steps == 6


# ------------------------------------------------------------------------ 9: our two Lightning plugins' checkpoints
def _drive(plugin: AmpPlusPrecision, steps: int, poison: set[int]) -> None:
    """Run the plugin's update cycle by hand (as its optimizer_step does) on a tiny model."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = plugin.engine
    for step in range(steps):
        loss = model(torch.ones(2, 4)).sum() * (float("inf") if step in poison else 1.0)
        engine.scale(loss).backward()
        engine.begin(opt, step)
        engine.unscale(opt)
        engine.step(opt)
        engine.end_cycle()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("saver", "loader"), [(AmpPlusPrecision, AmpPlusFSDPPrecision), (AmpPlusFSDPPrecision, AmpPlusPrecision)]
)
def test_each_plugin_resumes_the_others_checkpoint(saver, loader):
    old = saver("16-mixed", init_scale=1024.0)
    _drive(old, 5, poison={1, 3})
    checkpoint = {type(old).__qualname__: old.state_dict()}
    old.on_save_checkpoint(checkpoint)
    new = loader("16-mixed", init_scale=1024.0)
    new.on_load_checkpoint(checkpoint)  # as Lightning restores: the hook, then the state under its own key
    if type(new).__qualname__ in checkpoint:
        new.load_state_dict(checkpoint[type(new).__qualname__])
    assert new.scaler.get_scale() == 256.0
    assert new.history.skipped_steps == [1, 3]
    assert new.history.curve() == old.history.curve()


# ---------------------------------------------------------------------------------- 10: one x axis for every series
def test_a_gans_amp_series_share_the_steps_of_its_own_logged_metrics(tmp_path):
    model = FusedGAN(poison={3})
    logger = CSVLogger(tmp_path)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    monitor = LossScaleMonitor(logging_interval=1, progress_bar=False)
    make_trainer(plugins=[plugin], callbacks=[monitor], logger=logger, max_steps=16, log_every_n_steps=1).fit(model)
    rows = _rows(logger.experiment.metrics_file_path)
    ours = {int(r["step"]) for r in rows if r.get("amp/loss_scale")}
    theirs = {int(r["step"]) for r in rows if r.get("g_loss")}
    assert ours == theirs == set(range(8))  # not global steps 0, 2, ..., 14
    assert plugin.history.skipped_steps == [3]
    skipped = [int(r["step"]) for r in rows if r.get("amp/skipped_steps") and float(r["amp/skipped_steps"]) == 1.0]
    assert min(skipped) == 3


# -------------------------------------------------------------------------------------- 11: a new fit starts afresh
def test_reused_plugin_and_callbacks_start_afresh_for_a_new_trainer(tmp_path, caplog):
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    monitor = LossScaleMonitor(logging_interval=2, progress_bar=False)
    reporter = NaNSkipReporter(max_warnings=0)
    for run, poison in ((0, {4: "inf"}), (1, {2: "inf"})):
        logger = CSVLogger(tmp_path, name=f"run{run}")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_amp_plus"):
            make_trainer(plugins=[plugin], callbacks=[monitor, reporter], logger=logger, max_steps=6).fit(
                TinyModel(poison=poison)
            )
        rows = _rows(logger.experiment.metrics_file_path)
        assert {int(r["step"]) for r in rows if r.get("amp/loss_scale")} >= {0, 1, 3, 5}  # the start, then 1, 3, 5
        assert plugin.history.num_steps == 6
        assert plugin.history.skipped_steps == [min(poison)]
        assert plugin.history.scale_at(0) == 2.0**10  # init_scale again, not the first run's last scale
        assert reporter.skipped_steps == [min(poison)]
        summary = [r.getMessage() for r in caplog.records if "updates skipped" in r.getMessage()]
        assert len(summary) == 1
        assert summary[0].startswith(f"`NaNSkipReporter`: 1 of 6 updates skipped (at step {min(poison)}); worst")


def test_validate_after_fit_keeps_the_fits_history():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    model = TinyModel(poison={1: "inf"})
    model.validation_step = lambda batch, batch_idx: None
    trainer = make_trainer(plugins=[plugin], max_steps=4)
    trainer.fit(model)
    trainer.validate(model, dataloaders=make_loader(n=8))
    assert plugin.history.skipped_steps == [1]
    assert plugin.history.num_steps == 4


# -------------------------------------------------------------------------------- 12: the user's names under Fabric
def test_fabric_offenders_carry_the_users_names():
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=1024.0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    reporter = NaNSkipReporter(max_warnings=0)
    reporter.attach(plugin, model)  # the wrapper, as the README shows
    x, y = next(iter(make_loader()))
    handle = net[2].weight.register_hook(lambda g: g * float("inf"))
    fabric.backward(nn.functional.mse_loss(model(x), y))
    handle.remove()
    opt.step()
    assert [o["name"] for o in reporter.skips[0]["offenders"]] == ["2.weight"]


# -------------------------------------------------------------------------------- 13: an optimizer with no gradient
class UnusedModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.used = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_used, opt_unused = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.used(x).float(), y))
        opt_used.step()
        opt_unused.step()  # its parameters received no gradient: a no-op, as in 32-bit
        opt_used.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.used.parameters(), lr=LR), torch.optim.Adam(self.unused.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        return make_loader()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_an_optimizer_without_gradients_steps_as_a_no_op(precision):
    model = UnusedModule()
    unused_before = [p.detach().clone() for p in model.unused.parameters()]
    used_before = [p.detach().clone() for p in model.used.parameters()]
    plugin = AmpPlusPrecision(precision, **({"init_scale": 2.0**10} if precision == "16-mixed" else {}))
    make_trainer(plugins=[plugin], max_steps=8).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(unused_before, model.unused.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(used_before, model.used.parameters(), strict=True))
    assert plugin.history.num_steps == 4
    assert plugin.history.skipped_steps == []


# --------------------------------------------------------------------------- 14: factors float32 cannot tell from 1
@pytest.mark.parametrize(
    ("knob", "value", "match"),
    [
        ("growth_factor", 1 + 1e-12, r"growth_factor=1.000000000001\)` is invalid: float32 rounds it to 1.0"),
        ("backoff_factor", 1 - 1e-12, r"backoff_factor=0.999999999999\)` is invalid: float32 rounds it to 1.0"),
    ],
)
def test_factors_that_are_one_in_float32_are_refused_by_name(knob, value, match):
    with pytest.raises(ValueError, match=match):
        AmpPlusPrecision("16-mixed", **{knob: value})
    with pytest.raises(ValueError, match=match.replace("AmpPlusPrecision", "DynamicLossScaler")):
        DynamicLossScaler("cpu", **{knob: value})


def test_the_smallest_factors_float32_tells_from_one_move_the_scale():
    scaler = DynamicLossScaler("cpu", init_scale=2.0**16, growth_factor=1 + 2**-23, growth_interval=1)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(model(torch.ones(1, 1)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() > 2.0**16


# --------------------------------------------------------------------------- 15: the streak warning, rank zero only
@pytest.mark.parametrize(("rank", "warns"), [(0, True), (1, False)])
def test_the_skip_streak_warning_comes_from_rank_zero_only(monkeypatch, rank, warns):
    monkeypatch.setattr("lightning_amp_plus.engine.global_rank", lambda: rank)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, min_scale=0.0, warn_skip_streak=3)
    model = TinyModel(poison={s: "inf" for s in range(6)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugins=[plugin], max_steps=6).fit(model)
    streaks = [w for w in caught if issubclass(w.category, AmpPlusWarning) and "in a row" in str(w.message)]
    assert len(streaks) == (1 if warns else 0)
    if warns:
        assert str(streaks[0].message).startswith("3 optimizer updates in a row were skipped")


# ----------------------------------------------------------------------------- 16: the plot command on a huge field
def test_plot_command_says_one_error_line_for_a_field_over_csvs_limit(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text("step,amp/loss_scale,note\n0,1024," + "x" * 200_000 + "\n")
    assert cli(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: ")
    assert "field larger than field limit" in err[0]


# -------------------------------------------------------------------------------------- the rule, read in one place
def test_the_history_counts_streaks_over_updates_and_keeps_them_across_a_checkpoint():
    history = ScaleHistory(capacity=4)
    flags = [0, 1, 1, 0, 1, 1, 1]
    for i, flag in enumerate(flags):
        history.record(10 * i, torch.tensor(8.0), torch.tensor(float(flag)))  # steps 10 apart: still consecutive
    assert [history.streak_at(s) for s in history.skipped_steps] == [1, 2, 1, 2, 3]
    assert history.trailing_skips == 3
    restored = ScaleHistory()
    restored.load_state_dict(history.state_dict())
    restored.record(70, torch.tensor(8.0), torch.tensor(1.0))
    assert restored.streak_at(70) == 4  # the streak continues across the checkpoint
    with pytest.raises(ValueError, match=r"streak_at\(step=30\)` is invalid: step 30 was not skipped"):
        history.streak_at(30)


def test_the_plugin_and_callbacks_pickle_after_a_fit_and_the_copy_starts_afresh(tmp_path):
    """ddp_spawn and checkpointing tools pickle them; a finished fit's Trainer must not stand in the way."""
    import pickle

    from lightning_amp_plus import LossScaleMonitor, NaNSkipReporter

    plugin, monitor, reporter = AmpPlusPrecision("16-mixed", init_scale=1024.0), LossScaleMonitor(), NaNSkipReporter()
    make_trainer(plugins=[plugin], callbacks=[monitor, reporter], max_steps=4, logger=CSVLogger(tmp_path)).fit(
        TinyModel(poison={1: "inf"})
    )
    assert reporter.skipped_steps == [1]
    copies = pickle.loads(pickle.dumps((plugin, monitor, reporter)))
    assert copies[2].skipped_steps == [1]  # the state travels
    make_trainer(plugins=[copies[0]], callbacks=list(copies[1:]), max_steps=2, logger=CSVLogger(tmp_path)).fit(
        TinyModel()
    )
    assert copies[2].skipped_steps == []  # a new Trainer's fit starts afresh
