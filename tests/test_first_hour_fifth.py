"""The first hour, fifth pass (issue 54): every printed cause is one the run had, resumed settings told truly.

Each defect a new user met, as a fit that has it and, where it applies, a healthy look-alike that stays silent.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.callbacks._skip_text import describe
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


# ------------------------------------------------------------------------- 5. bf16 has no loss scale to show
def test_a_bf16_skip_line_and_record_show_no_loss_scale(caplog):
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[reporter], max_steps=4).fit(
            TinyModel(poison={1: "nan"})
        )
    (record,) = reporter.skips
    assert (record["scale"], record["new_scale"]) == (None, None)  # absent, not a healthy-looking 1
    (line,) = [r.getMessage() for r in caplog.records if "step 1 skipped" in r.getMessage()]
    assert "loss scale" not in line
    assert line == describe(record)


def test_a_float16_skip_line_still_shows_its_scale(caplog):
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0)], callbacks=[reporter], max_steps=4).fit(
            TinyModel(poison={1: "nan"})
        )
    (line,) = [r.getMessage() for r in caplog.records if "step 1 skipped" in r.getMessage()]
    assert line.endswith("loss scale 8 -> 4")


# ------------------------------------------------------------------------- 6. a fit an exception ended
class _Guarded(TinyModel):
    """The user's own batch guard raises at step 5."""

    def training_step(self, batch, batch_idx):
        assert self.trainer.global_step != 5, "bad batch at step 5"
        return super().training_step(batch, batch_idx)


def test_a_fit_an_exception_ended_is_never_called_healthy(caplog, tmp_path):
    advisor = AmpAdvisor(report_path=str(tmp_path / "advice.json"))
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"), pytest.raises(AssertionError):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor], max_steps=10).fit(_Guarded())
    said = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor"))
    assert "healthy" not in said
    assert "AssertionError: bad batch at step 5" in said
    assert json.loads((tmp_path / "advice.json").read_text())["healthy"] is False


def test_the_same_fit_run_to_its_end_is_healthy(caplog):
    advisor = AmpAdvisor()
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor], max_steps=10).fit(TinyModel())
    said = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor"))
    assert "the run looks healthy" in said


# ------------------------------------------------------------------------- 4. a resumed plugin names what runs
def _resume(tmp_path, **knobs):
    """A 6-step fit under growth_interval=50 saved, then resumed to 10 steps with ``knobs``; the plugin, the call
    logged as ``amp/plugin``, and what was said."""
    import yaml
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_amp_plus import LossScaleMonitor

    first = AmpPlusPrecision("16-mixed", growth_interval=50)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(plugins=[first], callbacks=[saver], max_steps=6, enable_checkpointing=True).fit(TinyModel())
    plugin = AmpPlusPrecision("16-mixed", **knobs)
    logger = CSVLogger(tmp_path, name="resumed")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor()], logger=logger, max_steps=10).fit(
        TinyModel(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    logged = yaml.safe_load((tmp_path / "resumed" / "version_0" / "hparams.yaml").read_text())
    return plugin, logged["amp/plugin"]


def test_a_knob_given_on_resume_runs_and_is_what_the_plugin_names(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        plugin, logged = _resume(tmp_path, growth_interval=10, hysteresis=2)
    knobs = plugin.scaler.knobs()
    assert (knobs["growth_interval"], knobs["hysteresis"]) == (10, 2)  # given on resume: meant
    assert "growth_interval=10" in repr(plugin)
    assert "hysteresis=2" in repr(plugin)
    assert "growth_interval=10" in logged
    assert "hysteresis=2" in logged
    assert any("growth_interval=10 kept as given (the checkpoint's: 50)" in r.getMessage() for r in caplog.records)


def test_a_knob_not_given_on_resume_is_the_checkpoints_and_is_named(tmp_path):
    plugin, logged = _resume(tmp_path)
    assert plugin.scaler.knobs()["growth_interval"] == 50
    assert "growth_interval=50" in repr(plugin)
    assert "growth_interval=50" in logged


class _BackToTheDefault(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    def on_train_start(self, trainer, pl_module):
        trainer.precision_plugin.scaler.set_growth_interval(2000)


def test_a_knob_given_at_its_default_on_resume_is_the_checkpoints_and_the_documented_way_back_works(tmp_path):
    """Break pass on issue 54: a knob given at its default cannot be told from one left out (the checkpoints page
    says so, and how to go back to the default)."""
    plugin, _ = _resume(tmp_path, growth_interval=2000)
    assert plugin.scaler.knobs()["growth_interval"] == 50  # the checkpoint's
    assert "growth_interval=50" in repr(plugin)
    again = AmpPlusPrecision("16-mixed", growth_interval=2000)
    make_trainer(plugins=[again], callbacks=[_BackToTheDefault()], max_steps=10).fit(
        TinyModel(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert again.scaler.knobs()["growth_interval"] == 2000
    assert "growth_interval" not in repr(again)  # at its default: not named


# ----------------------------------------------------------- 2. offline advice states no cause it cannot see
class _Overflowing(TinyModel):
    """Its forward overflows float16 at every step (the loss inf): every skip is born in forward."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) * 1e5
        return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_offline_advise_never_says_backward_skips_of_a_forward_born_run(tmp_path, capsys, kind):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_amp_plus import LossScaleMonitor
    from lightning_amp_plus.__main__ import main

    logger = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind](tmp_path, name="run")
    advisor = AmpAdvisor(print_advice=False)
    callbacks = [LossScaleMonitor(logging_interval=2), NaNSkipReporter(max_consecutive_skips=None), advisor]
    plugin = AmpPlusPrecision("16-mixed", init_scale=4.0, min_scale=1.0)
    with pytest.raises(LossScaleCollapseError):  # at min_scale: the reporter stops the run
        make_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=12).fit(_Overflowing())
    if kind == "tb":
        logger.experiment.flush()
    assert plugin.history.num_skipped == plugin.history.num_steps >= 3
    assert "backward_skips" not in [a.code for a in advisor.advice]  # live: the watch says forward
    capsys.readouterr()
    main(["advise", logger.log_dir])
    out = capsys.readouterr().out
    assert "skipped" in out  # the log's skips are read
    assert "[backward_skips]" not in out  # no finding of it (the "not checked" line lists it)
    assert "forward and loss finite" not in out


class _NaNStart(TinyModel):
    """Its first three batches' losses are NaN (a corrupt start): skips no loss scale causes, at the run's start."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step < 3 else loss


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_offline_advise_never_calls_batch_born_leading_skips_the_init_scale(tmp_path, capsys, kind):
    """Break pass on issue 54: offline, three NaN-loss skips at the start were told `init_scale` (the scale's
    calibration). The reporter now logs whether each skip's loss was already inf/nan; `advise` reads it."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_amp_plus import LossScaleMonitor
    from lightning_amp_plus.__main__ import main

    logger = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind](tmp_path, name="run")
    callbacks = [LossScaleMonitor(), NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)]
    plugin = AmpPlusPrecision("16-mixed")
    make_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=12, log_every_n_steps=1).fit(
        _NaNStart()
    )
    if kind == "tb":
        logger.experiment.flush()
    assert plugin.history.skipped_steps == [0, 1, 2]
    capsys.readouterr()
    main(["advise", logger.log_dir])
    out = capsys.readouterr().out
    assert "init_scale" not in out
    assert "3 were born before backward (the loss was already inf/nan" in out
    assert "looks healthy" not in out


class _RaisesAtTrainEnd(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    def on_train_end(self, trainer, pl_module):
        raise RuntimeError("export failed")


def test_a_fit_that_raises_after_the_advice_was_given_is_not_left_healthy(tmp_path, caplog):
    advisor = AmpAdvisor(report_path=str(tmp_path / "advice.json"))
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"), pytest.raises(RuntimeError):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor, _RaisesAtTrainEnd()], max_steps=6).fit(
            TinyModel()
        )
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor")]
    assert "RuntimeError: export failed" in said[-1]
    assert json.loads((tmp_path / "advice.json").read_text())["healthy"] is False


class _Big(torch.nn.Module):
    """A Linear whose float16 output overflows on every 7th call."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y * 1e5 if self.calls % 7 == 0 else y


class _ThreeProblems(TinyModel):
    """A hand-written BCE on float16 sigmoid outputs, a module that overflows now and then, and (in the data) one
    NaN record: three distinct problems."""

    def __init__(self):
        super().__init__(lr=0.5, optimizer="adam")
        self.inp, self.big, self.head = torch.nn.Linear(8, 16), _Big(), torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        p = torch.sigmoid(self.head(torch.relu(self.big(self.inp(x)))))
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def test_every_distinct_problem_gets_its_line_most_important_first():
    """Break pass on issue 54: three problems gave one line (the loss's); the module's overflow and the NaN record
    were in `skips.json` only. Each now gets its line, most important first."""
    torch.manual_seed(0)
    x = torch.randn(64 * 40, 8)
    y = (x[:, :1] > 0).float()
    x = x * 30
    x[15 * 64 + 3, 2] = float("nan")
    advisor = AmpAdvisor(print_advice=False)
    reporter = NaNSkipReporter(max_warnings=0, max_consecutive_skips=None)
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter, advisor], max_steps=40)
    with pytest.raises(LossScaleCollapseError):  # the loss's problem walks the scale to its floor
        trainer.fit(_ThreeProblems(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64))
    origins = [r["origin"].get("module") or r["origin"]["phase"] for r in reporter.skips]
    assert {"loss", "big", "input"} <= set(origins)
    # and a fourth: the first 5 updates overflowed in backward while the scale came down from 2^16
    assert origins[:5] == ["backward"] * 5
    assert [a.code for a in advisor.advice] == ["nonfinite_loss", "fp32_module", "nonfinite_batches", "init_scale"]
    loss, module, batch, _ = advisor.advice
    assert "binary_cross_entropy_with_logits" in loss.fix
    assert module.fix.endswith('fp32_modules=["big"])')
    assert f"born in the batch (step {15})" in batch.message


def test_a_skip_line_says_a_minus_inf_loss_as_the_record_holds_it(caplog):
    """Break pass on issue 54: a first skip, read from a loss of -inf, said "the loss was inf" (its record: "-inf")."""
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0)], callbacks=[reporter], max_steps=4).fit(
            TinyModel(poison={1: "-inf"})
        )
    assert reporter.skips[0]["loss"] == "-inf"
    (line,) = [r.getMessage() for r in caplog.records if "step 1 skipped" in r.getMessage()]
    assert "(the loss was -inf;" in line


class _NaNFirstMicroBatch(TinyModel):
    """With accumulation over 2 batches: the first micro-batch of updates 0 to 2 has a NaN loss; the last is fine."""

    calls = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.calls += 1
        return loss * float("nan") if self.calls in (1, 3, 5) else loss


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_an_earlier_micro_batchs_nan_loss_is_the_updates_and_never_the_scales(tmp_path, capsys, kind):
    """Break pass on issue 54: a NaN loss in the first micro-batch was recorded with the last one's finite loss,
    told "born in backward", logged as a finite loss, and advised `init_scale` live and offline."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_amp_plus import LossScaleMonitor
    from lightning_amp_plus.__main__ import main

    logger = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind](tmp_path, name="run")
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed")
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), reporter, advisor],
        logger=logger,
        max_steps=10,
        log_every_n_steps=1,
        accumulate_grad_batches=2,
    )
    trainer.fit(_NaNFirstMicroBatch())
    if kind == "tb":
        logger.experiment.flush()
    assert plugin.history.skipped_steps == [0, 1, 2]
    assert [r["loss"] for r in reporter.skips] == ["nan"] * 3
    assert all(
        r["origin"]["phase"] == "forward" and "earlier micro-batch" in r["origin"]["reason"] for r in reporter.skips
    )
    assert "init_scale" not in [a.code for a in advisor.advice]
    capsys.readouterr()
    main(["advise", logger.log_dir])
    out = capsys.readouterr().out
    assert "[init_scale]" not in out
    assert "3 were born before backward" in out
