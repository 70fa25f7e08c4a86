"""A new user's first hour (issue 46): each advice chain ends in the fix that works, no figure is invented, quiet
means quiet, and each error says what the user most likely meant.

Every chain is followed as a user would: the printed fix is pasted (evaluated as printed) and the run made again.
"""

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleCollapseError, LossScaleMonitor, NaNSkipReporter
from lightning_amp_plus.__main__ import main
from lightning_amp_plus.plot import read_series
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Huge(TinyModel):
    """A loss 1e6 too large: its gradients overflow float16 at every loss scale, min_scale included."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e6


def _fit(model, plugin, callbacks=(), steps=30, **trainer):
    """Fit; returns the collapse error's message (None: the fit ran to its end)."""
    torch.manual_seed(0)
    try:
        make_trainer(plugins=[plugin], callbacks=list(callbacks), max_steps=steps, **trainer).fit(model)
    except LossScaleCollapseError as error:
        return str(error)
    return None


def _pasted(fix):
    """The fix as a user pastes it: its code, evaluated (the comment after `#` is the user's to read)."""
    return eval(fix.split("  #")[0], {"AmpPlusPrecision": AmpPlusPrecision, "NaNSkipReporter": NaNSkipReporter})


# ---------------------------------------------------------------------------------------------- defect 1
def test_the_chain_from_backward_skips_ends_in_the_fix_that_trains():
    """Advisor alone -> its fix (a rerun by name) -> the collapse's HINT -> a run with no skip."""
    advisor = AmpAdvisor(print_advice=False)
    assert _fit(Huge(optimizer="adamw", lr=1e-3), AmpPlusPrecision("16-mixed"), [advisor]) is None
    (first,) = advisor.advice
    assert first.code == "backward_skips"
    reporter = _pasted(first.fix)  # NaNSkipReporter(backward_origin=True)
    assert isinstance(reporter, NaNSkipReporter)
    assert reporter.backward_origin
    advisor = AmpAdvisor(print_advice=False)
    error = _fit(Huge(optimizer="adamw", lr=1e-3), AmpPlusPrecision("16-mixed"), [reporter, advisor])
    assert error is not None  # it overflowed at min_scale: stopped, with the diagnosis and its fix
    assert "a rerun found the gradients finite in float32" in error
    hint = error.split("HINT: ")[1]
    assert [a.code for a in advisor.advice] == ["bf16"]  # the advisor says the same, never only `skip_rate`
    assert advisor.advice[0].fix == hint
    plugin = _pasted(hint)  # AmpPlusPrecision("bf16-mixed")
    assert _fit(Huge(optimizer="adamw", lr=1e-3), plugin, steps=30) is None
    assert plugin.history.num_steps == 30
    assert plugin.history.num_skipped == 0  # the fix that works: every update applied


# ---------------------------------------------------------------------------------------------- defect 2
def test_a_stock_runs_log_is_never_called_healthy(tmp_path, capsys):
    """Lightning's plugin logs no skip: the verdict says what could not be judged, never "0 skipped"."""
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    trainer = make_trainer(
        plugins=[stock], callbacks=[LossScaleMonitor()], logger=CSVLogger(tmp_path), max_steps=20, log_every_n_steps=1
    )
    trainer.fit(TinyModel(poison={3: "inf", 7: "nan"}))
    assert main(["advise", trainer.logger.log_dir]) == 0
    out = capsys.readouterr().out
    assert "its skipped updates were not logged (Lightning's own plugin logs none)" in out
    assert "could not be judged" in out
    assert "healthy" not in out
    assert "skip rate" not in out  # no "0 skipped"


# ---------------------------------------------------------------------------------------------- defect 3
def test_a_quiet_reporter_says_and_writes_nothing(tmp_path, caplog):
    caplog.set_level("INFO", logger="lightning_amp_plus")
    report = tmp_path / "skips.json"
    logger = CSVLogger(tmp_path)
    reporter = NaNSkipReporter(quiet=True, report_path=report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        _fit(TinyModel(poison={2: "inf", 5: "nan"}), plugin, [reporter], 8, logger=logger)
    assert not [w for w in caught if "NaNSkipReporter" in str(w.message)]  # no warning
    assert [r["step"] for r in reporter.skips] == [2, 5]  # it records
    assert not report.exists()  # no file
    assert not [r for r in caplog.records if r.name == "lightning_amp_plus"]  # no line
    metrics = logger.experiment.metrics_file_path
    assert not os.path.exists(metrics) or "amp/" not in Path(metrics).read_text()  # no metric
    loud = NaNSkipReporter(report_path=report)  # the same run, not quiet: all of them
    _fit(TinyModel(poison={2: "inf", 5: "nan"}), AmpPlusPrecision("16-mixed", init_scale=1024.0), [loud], 8)
    assert json.loads(report.read_text())["skipped_steps"] == [2, 5]
    assert any(r.getMessage().startswith("`NaNSkipReporter`: 2 of 8 updates skipped") for r in caplog.records)


# ---------------------------------------------------------------------------------------------- defect 4, friction 9
class Evaluated(TinyModel):
    def validation_step(self, batch, batch_idx):
        return None

    def test_step(self, batch, batch_idx):
        return None

    def val_dataloader(self):
        return self.train_dataloader()

    def test_dataloader(self):
        return self.train_dataloader()


@pytest.mark.parametrize("stock", [False, True])
def test_the_no_logger_warning_is_said_once_and_true_of_the_plugin(stock):
    plugin = (
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")) if stock else AmpPlusPrecision("16-mixed")
    )
    trainer = make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor()], max_steps=2, limit_val_batches=1)
    model = Evaluated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
        trainer.validate(model)
        trainer.test(model)
    (said,) = [str(w.message) for w in caught if "LossScaleMonitor" in str(w.message)]
    if stock:
        assert said.endswith("Lightning's own plugin keeps no curve (`AmpPlusPrecision` keeps it in `.history`).")
        assert not hasattr(plugin, "history")
    else:
        assert "the curve is kept in `AmpPlusPrecision.history`" in said
        assert plugin.history.num_steps == 2


# ---------------------------------------------------------------------------------------------- friction 7
class NaNBatches(TinyModel):
    """Batches 1, 3, 5, ... hold NaN in their inputs."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        y = x.sum(1, keepdim=True) * 0.1
        for i in range(1, 16, 2):
            x[4 * i] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=4)


class HugeAfterANaNBatch(Huge):
    """Every update overflows in backward; the odd batches hold NaN besides."""

    train_dataloader = NaNBatches.train_dataloader


def test_a_collapse_driven_by_bad_batches_says_the_batches():
    error = _fit(NaNBatches(), AmpPlusPrecision("16-mixed", init_scale=8.0), [NaNSkipReporter(max_warnings=0)], 16)
    assert error.startswith("Mixed-precision training collapsed: step 7 overflowed while the loss scale already sat")
    assert "The batch's inf/nan reached the model in 4 of 4 skipped updates: not a scaling problem" in error
    assert "born in the batch (inf/nan in the data)" not in error  # said once, by the diagnosis
    assert error.split("HINT: ")[1].startswith("assert all(torch.isfinite(t).all() for t in batch")


@pytest.mark.parametrize("max_records", [100, 4])
def test_a_collapse_with_some_bad_batches_counts_them_beside_its_diagnosis(max_records):
    """Counted over every skip, not only the records kept (`max_records`)."""
    reporter = NaNSkipReporter(max_warnings=0, max_records=max_records)
    error = _fit(HugeAfterANaNBatch(), AmpPlusPrecision("16-mixed"), [reporter])
    assert len(reporter.skips) == min(17, max_records)
    assert "collapsed: step 16 overflowed while the loss scale already sat at min_scale=1" in error
    assert (
        "Of the 17 skipped updates so far, 8 were born in the batch (inf/nan in the data): the scale backed off for"
        " them too, though no loss scale fixes data." in error
    )
    assert 'AmpPlusPrecision(..., backoff_on="backward")` leaves the scale alone for them.' in error


def test_a_real_overflow_collapse_says_nothing_of_batches():
    error = _fit(Huge(), AmpPlusPrecision("16-mixed"), [NaNSkipReporter(max_warnings=0)])
    assert "collapsed: step 16 overflowed" in error
    assert "batch" not in error


# ---------------------------------------------------------------------------------------------- friction 8
@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("16", "use precision='16-mixed'"),
        ("fp16", "use precision='16-mixed'"),
        ("float16", "use precision='16-mixed'"),
        (16, "use precision='16-mixed'"),
        ("bf16", "use precision='bf16-mixed'"),
        ("bfloat16", "use precision='bf16-mixed'"),
        ("16-true", "for pure half precision leave it out (`Trainer(precision='16-true')`)"),
        ("32", "for fp32 leave the plugin out"),
    ],
)
def test_a_refused_precision_names_the_one_meant(given, hint):
    with pytest.raises(ValueError, match=re.escape(f"`AmpPlusPrecision(precision={given!r})` is invalid")) as error:
        AmpPlusPrecision(given)
    assert hint in str(error.value)


class Normed(TinyModel):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def test_a_class_name_in_fp32_modules_gets_its_import_path():
    with pytest.raises(ValueError, match="matches no module of Normed") as error:
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", fp32_modules=["LayerNorm"])], max_steps=1).fit(Normed())
    assert "HINT: 'LayerNorm' is a class name: give the class or its import path, \"torch.nn.LayerNorm\"" in str(
        error.value
    )
    seen = []

    class Islands(Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(trainer.precision_plugin.fp32_module_names)

    plugin = AmpPlusPrecision("16-mixed", fp32_modules=["torch.nn.LayerNorm"])  # the hint, as printed
    make_trainer(plugins=[plugin], callbacks=[Islands()], max_steps=1).fit(Normed())
    assert seen == [["net.1"]]


def test_a_mistyped_class_path_is_told_as_a_failed_import():
    with pytest.raises(ValueError, match="matches no module of Normed") as error:
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", fp32_modules=["torch.nn.LayerNormX"])], max_steps=1).fit(
            Normed()
        )
    assert str(error.value).endswith(
        "HINT: read as a module name, since `torch.nn` has no module class `LayerNormX`. Did you mean"
        " torch.nn.LayerNorm?"
    )


# ---------------------------------------------------------------------------------------------- friction 10
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_plot_and_advise_read_what_to_csv_writes(tmp_path, capsys, precision):
    plugin = AmpPlusPrecision(precision, **({"init_scale": 1024.0} if precision == "16-mixed" else {}))
    make_trainer(plugins=[plugin], max_steps=12).fit(TinyModel(poison={3: "inf", 7: "nan"}))
    path = tmp_path / "history.csv"
    plugin.history.to_csv(path)
    series = read_series(path)
    assert [s for s, v in series["step_skipped"] if v] == plugin.history.skipped_steps == [3, 7]
    assert series["applied_steps"][-1] == (11, 10.0)  # to the last update
    if precision == "16-mixed":
        changes = [
            (s, v) for i, (s, v) in enumerate(series["loss_scale"]) if i == 0 or series["loss_scale"][i - 1][1] != v
        ]
        assert changes == plugin.history.curve()
    else:
        assert "loss_scale" not in series  # bf16 has no scale: none is invented
    png = tmp_path / "h.png"
    assert main(["plot", str(path), "-o", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert main(["advise", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 of 12 updates were skipped (16.7%)" in out  # two poisoned losses: never healthy


# ---------------------------------------------------------------------------------------------- friction 11
def test_plot_names_the_one_run_it_drew(tmp_path, capsys):
    logger = CSVLogger(tmp_path)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed")], callbacks=[LossScaleMonitor()], logger=logger, max_steps=4
    ).fit(TinyModel())
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "a.png")]) == 0
    run = os.path.join(str(tmp_path), "lightning_logs", "version_0", "metrics.csv")
    assert capsys.readouterr().out.splitlines()[0] == f"the one run at {tmp_path}: {run}"
    assert main(["plot", run, "-o", str(tmp_path / "b.png")]) == 0
    assert not capsys.readouterr().out.startswith("the one run at")  # the run itself: no need to name it


def test_the_advice_reads_every_skips_origin_not_only_the_records_kept():
    reporter = NaNSkipReporter(max_warnings=0, max_records=4, max_consecutive_skips=None)
    advisor = AmpAdvisor(print_advice=False)
    _fit(NaNBatches(), AmpPlusPrecision("16-mixed"), [reporter, advisor], 16)
    assert (reporter.num_skips, len(reporter.skips)) == (8, 4)
    (advice,) = advisor.advice
    assert advice.code == "nonfinite_loss"
    assert advice.evidence["input"] == advice.evidence["told"] == 8
    assert "in 8 of 8 skipped updates" in advice.message
