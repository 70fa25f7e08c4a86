import csv
import math

import lightning
import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer

_LIGHTNING = tuple(int(p) for p in lightning.__version__.split(".")[:2])


def reference_scales(n_steps, overflows, init, growth_interval):
    """The scale each step used, by the rule in plain Python (hysteresis 1, no bounds hit)."""
    scale, tracker, out = init, 0, []
    for step in range(n_steps):
        out.append(scale)
        if step in overflows:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * 2, 0
    return out


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_csv_curve_is_the_true_step_function(tmp_path):
    overflows = {3, 4, 11}
    model = TinyModel(poison={s: "inf" for s in overflows})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=4)
    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(
        plugins=[plugin], callbacks=[LossScaleMonitor()], logger=logger, max_steps=20, log_every_n_steps=5
    )
    trainer.fit(model)
    rows = read_csv(logger.experiment.metrics_file_path)
    logged = {int(r["step"]): float(r["amp/loss_scale"]) for r in rows if r.get("amp/loss_scale")}
    expected = reference_scales(20, overflows, 1024.0, 4)
    for step, value in logged.items():
        assert value == expected[step]
        assert math.log2(value) == float(
            next(r for r in rows if r.get("amp/log2_loss_scale") and int(r["step"]) == step)["amp/log2_loss_scale"]
        )
    # every change point is logged, even between logging points, so the step function can be rebuilt exactly
    changes = [s for s in range(1, 20) if expected[s] != expected[s - 1]]
    assert set(changes) <= set(logged)
    rebuilt = [logged[max(s for s in logged if s <= step)] for step in range(20)]
    assert rebuilt == expected
    skipped = {int(r["step"]): float(r["amp/skipped_steps"]) for r in rows if r.get("amp/skipped_steps")}
    assert skipped[19] == 3.0
    assert skipped[3] == 1.0
    assert skipped[4] == 2.0
    assert skipped[11] == 3.0
    # logging points are Lightning's own for log_every_n_steps=5: 4, 9, 14, 19
    rate_steps = sorted(int(r["step"]) for r in rows if r.get("amp/skip_rate"))
    assert rate_steps == [4, 9, 14, 19]
    rates = {int(r["step"]): float(r["amp/skip_rate"]) for r in rows if r.get("amp/skip_rate")}
    assert rates == {4: 2 / 5, 9: 0.0, 14: 1 / 5, 19: 0.0}


def test_tensorboard_tag_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = TinyModel(poison={2: "nan"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    logger = TensorBoardLogger(tmp_path, name="tb")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=3)], logger=logger, max_steps=7).fit(
        model
    )
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    events = {e.step: e.value for e in acc.Scalars("amp/loss_scale")}
    assert events[0] == 256.0
    assert events[3] == 128.0
    assert events[6] == 128.0
    assert {e.step: e.value for e in acc.Scalars("amp/skipped_steps")}[2] == 1.0


def test_prefix_and_no_logger_warning():
    model = TinyModel()
    plugin = AmpPlusPrecision("16-mixed")
    with pytest.warns(UserWarning, match="has no logger.*AmpPlusPrecision.history"):
        make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(prefix="x/")], max_steps=2).fit(model)
    assert plugin.history.num_steps == 2


def test_needs_the_plugin():
    with pytest.raises(ValueError, match=r"`LossScaleMonitor` needs the `AmpPlusPrecision` plugin.*HINT"):
        make_trainer(callbacks=[LossScaleMonitor()], max_steps=1).fit(TinyModel())


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"logging_interval": 0}, "logging_interval=0"), ({"prefix": 1}, "prefix=1")]
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LossScaleMonitor(**kwargs)


class EpochModel(TinyModel):
    def train_dataloader(self):
        return make_loader(n=24, batch_size=4)  # 6 batches an epoch


def _fit(tmp_path, name, max_steps, ckpt_path=None, checkpoint=None):
    seed_everything(7)
    model = EpochModel(poison={2: "inf", 8: "inf", 9: "nan"}, optimizer="adam", lr=1e-2)
    plugin = AmpPlusPrecision("16-mixed", init_scale=512.0, growth_interval=3)
    callbacks = [LossScaleMonitor(logging_interval=2)]
    if checkpoint is not None:
        callbacks.append(checkpoint)
    logger = CSVLogger(tmp_path, name=name)
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=callbacks,
        logger=logger,
        max_steps=max_steps,
        enable_checkpointing=checkpoint is not None,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, plugin, logger


@pytest.mark.skipif(
    _LIGHTNING < (2, 5),
    reason="Lightning 2.4 replays one batch when resuming from a checkpoint written at an epoch end (stock too)",
)
def test_resume_gives_the_same_curve_skips_and_parameters(tmp_path):
    # a step-based checkpoint at the epoch boundary (Lightning replays a batch when resuming from a checkpoint
    # written in `on_train_epoch_end`, with or without this package)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=6)
    full_model, full, full_logger = _fit(tmp_path, "full", 12, checkpoint=ckpt)
    first = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    assert first.exists()
    resumed_model, resumed, resumed_logger = _fit(tmp_path, "resumed", 12, ckpt_path=str(first))
    assert resumed.history.curve() == full.history.curve()
    assert resumed.history.skipped_steps == full.history.skipped_steps == [2, 8, 9]
    assert resumed.scaler.state_dict() == full.scaler.state_dict()
    for a, b in zip(full_model.parameters(), resumed_model.parameters(), strict=False):
        assert torch.equal(a, b)
    full_rows = [r for r in read_csv(full_logger.experiment.metrics_file_path) if int(r["step"]) >= 6]
    resumed_rows = read_csv(resumed_logger.experiment.metrics_file_path)
    key = lambda rows: sorted((int(r["step"]), r.get("amp/loss_scale", "")) for r in rows if r.get("amp/loss_scale"))  # noqa: E731
    assert key(resumed_rows) == key(full_rows)


def test_skip_rate_counts_cycles_with_two_optimizers(tmp_path):
    from tests.test_precision import TwoOptimizers

    class EveryBatchOverflows(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            self.poison_step = self.trainer.global_step
            return super().training_step(batch, batch_idx)

    logger = CSVLogger(tmp_path)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, min_scale=0.0)
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=100)], logger=logger, max_steps=6).fit(
        EveryBatchOverflows(poison_step=-1)
    )
    rows = read_csv(logger.experiment.metrics_file_path)
    rates = [float(r["amp/skip_rate"]) for r in rows if r.get("amp/skip_rate")]
    assert plugin.history.skipped_steps == [0, 1, 2]  # one update per batch, at the logger step (not global_step)
    assert rates[-1] == 1.0  # every cycle skipped, not 3 of a 5-step range


def test_counter_metrics_match_the_rule_at_every_logging_point(tmp_path):
    overflows = {3, 4, 11, 12, 13}
    model = TinyModel(poison={s: "inf" for s in overflows})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    logger = CSVLogger(tmp_path, name="run")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=4)], logger=logger, max_steps=22).fit(
        model
    )
    scales = reference_scales(22, overflows, 1024.0, 3)
    rows = {}
    for row in read_csv(logger.experiment.metrics_file_path):
        for key, value in row.items():
            if value:
                rows.setdefault(int(row["step"]), {})[key] = float(value)
    points = sorted(s for s, r in rows.items() if "amp/growths" in r)
    assert points == [3, 7, 11, 15, 19, 21]  # Lightning's logging steps for 4, and the end
    for s in points:
        seen = scales[: s + 1]
        growths = sum(b > a for a, b in zip(seen, seen[1:], strict=False))
        backoffs = sum(b < a for a, b in zip(seen, seen[1:], strict=False))
        skipped = sum(1 for o in overflows if o <= s)
        assert rows[s]["amp/growths"] == growths, s
        assert rows[s]["amp/backoffs"] == backoffs, s
        assert rows[s]["amp/applied_steps"] == s + 1 - skipped, s
        assert rows[s]["amp/skipped_steps"] == skipped, s
        assert rows[s]["amp/loss_scale"] == scales[s], s
    assert rows[21]["amp/growths"] >= 2
    assert rows[21]["amp/backoffs"] == 5


def test_consecutive_skips_metric_counts_each_streak(tmp_path):
    from lightning_amp_plus import NaNSkipReporter

    model = TinyModel(poison={s: "inf" for s in (2, 3, 4, 7)})
    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[NaNSkipReporter(max_warnings=0)], logger=logger, max_steps=9).fit(model)
    rows = read_csv(logger.experiment.metrics_file_path)
    streak = {int(r["step"]): float(r["amp/consecutive_skips"]) for r in rows if r.get("amp/consecutive_skips")}
    assert streak == {2: 1.0, 3: 2.0, 4: 3.0, 7: 1.0}
    marked = {int(r["step"]) for r in rows if r.get("amp/step_skipped") == "1.0"}
    assert marked == {2, 3, 4, 7}


def test_plot_marks_the_skips_from_monitor_only_logs(tmp_path):
    from lightning_amp_plus.plot import read_run

    model = TinyModel(poison={2: "inf", 5: "nan"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    logger = CSVLogger(tmp_path, name="run")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=4)], logger=logger, max_steps=9).fit(
        model
    )
    curves = read_run(logger.log_dir)  # no NaNSkipReporter: the markers come from amp/skipped_steps
    assert curves.skipped == plugin.history.skipped_steps == [2, 5]
    changes = [(s, v) for i, (s, v) in enumerate(curves.scale) if i == 0 or v != curves.scale[i - 1][1]]
    assert changes == plugin.history.curve()  # the logged samples trace the same step function


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_progress_bar_shows_the_scale_and_skips_refreshed_at_logging_points(tmp_path, bar):
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    shown = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.progress_bar_callback.get_metrics(trainer, pl_module)  # what the bar prints
            shown.append((trainer.global_step, metrics.get("amp/scale"), metrics.get("amp/skipped")))

    model = TinyModel(poison={2: "inf", 5: "inf"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=100)
    progress = TQDMProgressBar() if bar == "tqdm" else RichProgressBar()
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=3), Probe(), progress],
        logger=CSVLogger(tmp_path),
        enable_progress_bar=True,
        log_every_n_steps=1,  # what reaches the logger is written at every step: the bar's values must not be
        max_steps=8,
    ).fit(model)
    # after the batch of each logging point (Lightning's steps 2 and 5) the bar shows that point's scale and skips
    assert shown[0][1:] == shown[1][1:] == (None, None)  # nothing before the first logging point
    assert shown[2] == (3, "2^10", "1")  # step 2 used 1024 and was skipped (as text: no `1024.000`)
    assert shown[5] == (6, "2^9", "2")  # step 5 used the halved scale and was skipped
    assert shown[3][1:] == shown[4][1:] == ("2^10", "1")  # unchanged between logging points
    assert "get_metrics" not in vars(progress)  # the bar is given back at teardown
    rows = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert {"amp/loss_scale", "amp/skipped_steps"} <= set(rows[0])  # the monitor's own metrics reach the logger
    assert not {"amp/scale", "amp/skipped"} & set(rows[0])  # the bar's do not


@pytest.mark.parametrize(("progress_bar", "enable_progress_bar"), [(False, True), (True, False)])
def test_no_bar_metric_without_a_bar_or_when_turned_off(tmp_path, progress_bar, enable_progress_bar):
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed")],
        callbacks=[LossScaleMonitor(logging_interval=1, progress_bar=progress_bar)],
        logger=CSVLogger(tmp_path),
        enable_progress_bar=enable_progress_bar,
        max_steps=2,
    )
    trainer.fit(TinyModel())
    assert not {"amp/scale", "amp/skipped"} & set(trainer.progress_bar_metrics)
    if trainer.progress_bar_callback is not None:
        assert not {"amp/scale", "amp/skipped"} & set(trainer.progress_bar_callback.get_metrics(trainer, None))


def test_a_run_shorter_than_one_interval_rates_every_update_at_its_end(tmp_path):
    logger = CSVLogger(tmp_path)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[LossScaleMonitor()],
        logger=logger,
        log_every_n_steps=5,
        max_steps=3,
    ).fit(TinyModel(poison={0: "inf"}))
    rows = read_csv(logger.experiment.metrics_file_path)
    assert {int(r["step"]): float(r["amp/skip_rate"]) for r in rows if r.get("amp/skip_rate")} == {2: 1 / 3}


def test_stock_plugin_gets_a_sampled_curve_said_once(tmp_path, caplog):
    from lightning.pytorch.plugins.precision import MixedPrecision

    true_scales = {}

    class Truth(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            true_scales[trainer.global_step] = trainer.precision_plugin.scaler.get_scale()

    model = TinyModel(poison={s: "inf" for s in (2, 3, 9)})
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4))
    logger = CSVLogger(tmp_path, name="stock")
    make_trainer(
        plugins=[stock],
        callbacks=[Truth(), LossScaleMonitor(logging_interval=3)],
        logger=logger,
        max_steps=14,
    ).fit(model)
    rows = read_csv(logger.experiment.metrics_file_path)
    sampled = {int(r["step"]): float(r["amp/loss_scale"]) for r in rows if r.get("amp/loss_scale")}
    assert sorted(sampled) == [2, 5, 8, 11, 14]  # Lightning's logging steps for 3
    assert sampled == {s: true_scales[s] for s in sampled}  # the stock scaler's real values at the sample points
    backoffs = {int(r["step"]): float(r["amp/backoffs"]) for r in rows if r.get("amp/backoffs")}
    values = [sampled[s] for s in sorted(sampled)]  # 1024, 256, 512, 256, 512: drops and rises between samples
    assert backoffs[14] == sum(b < a for a, b in zip(values, values[1:], strict=False)) == 2
    growths = {int(r["step"]): float(r["amp/growths"]) for r in rows if r.get("amp/growths")}
    assert growths[14] == sum(b > a for a, b in zip(values, values[1:], strict=False)) == 2
    assert caplog.text.count("is sampled at the logging points") == 1
    from lightning_amp_plus.plot import read_run

    assert read_run(logger.log_dir).scale[0] == (2, sampled[2])  # the plot command reads it


def test_repr_shows_the_knobs_that_differ_from_the_defaults():
    from lightning_amp_plus import AmpPlusFabricPrecision, AmpPlusFSDPPrecision, NaNSkipReporter

    assert repr(AmpPlusPrecision("16-mixed", growth_interval=500)) == "AmpPlusPrecision(growth_interval=500)"
    assert repr(AmpPlusPrecision("bf16-mixed")) == "AmpPlusPrecision(precision='bf16-mixed')"
    assert repr(AmpPlusFabricPrecision(update="manual")) == "AmpPlusFabricPrecision(update='manual')"
    assert repr(AmpPlusFSDPPrecision(init_scale=8.0)) == "AmpPlusFSDPPrecision(init_scale=8.0)"
    assert repr(LossScaleMonitor()) == "LossScaleMonitor()"
    assert repr(NaNSkipReporter(max_consecutive_skips=None)) == "NaNSkipReporter(max_consecutive_skips=None)"


def test_stock_plugin_sampling_under_accumulation_counts_by_comparing_samples(tmp_path):
    """Stock scaler, 2 batches per update: the first batch end and then every 3rd update, each once; a sample equal
    to the previous one is neither growth nor backoff, and every rise counts; the bar shows the sampled scale."""
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.plugins.precision import MixedPrecision

    bar = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar.append(trainer.progress_bar_callback.get_metrics(trainer, pl_module).get("amp/scale"))

    # growth_interval 6: two rises 6 updates apart, equal samples between them, one backoff at update 13
    model = TinyModel(poison={13: "inf"})
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=6)
    logger = CSVLogger(tmp_path, name="stock")
    make_trainer(
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[LossScaleMonitor(logging_interval=3), Probe(), TQDMProgressBar()],
        logger=logger,
        enable_progress_bar=True,
        accumulate_grad_batches=2,
        max_steps=16,
        limit_train_batches=40,
    ).fit(model)
    rows = [r for r in read_csv(logger.experiment.metrics_file_path) if r.get("amp/loss_scale")]
    steps = [int(r["step"]) for r in rows]
    assert steps == [2, 5, 8, 11, 14]  # once each, though two batch ends share every update's step
    values = [float(r["amp/loss_scale"]) for r in rows]
    assert values == [256.0, 256.0, 512.0, 512.0, 512.0]  # grown after update 6; 12's growth undone at 13, unseen
    assert [float(r["amp/growths"]) for r in rows] == [0, 0, 1, 1, 1]
    assert [float(r["amp/backoffs"]) for r in rows] == [0, 0, 0, 0, 0]
    assert bar[0] is None  # the bar shows the samples, from the first logging point
    assert bar[-1] == "2^9"


@pytest.mark.parametrize("ours", [True, False])
def test_a_bf16_plugin_logs_no_scale(tmp_path, ours):
    from lightning.pytorch.plugins.precision import MixedPrecision

    logger = CSVLogger(tmp_path, name="bf16")
    make_trainer(
        plugins=[AmpPlusPrecision("bf16-mixed") if ours else MixedPrecision("bf16-mixed", "cpu")],
        callbacks=[LossScaleMonitor(logging_interval=1)],
        logger=logger,
        max_steps=3,
    ).fit(TinyModel())
    path = tmp_path / "bf16" / "version_0" / "metrics.csv"
    logged = {k for r in read_csv(path) for k, v in r.items() if v} if path.exists() else set()
    assert not logged & {"amp/loss_scale", "amp/log2_loss_scale", "amp/growths", "amp/backoffs"}


def test_amp_series_share_lightnings_logging_steps(tmp_path):
    from lightning_amp_plus import GradUnderflowMonitor

    class Logged(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

    logger = CSVLogger(tmp_path, name="run")
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=1000)],
        callbacks=[LossScaleMonitor(), GradUnderflowMonitor()],
        logger=logger,
        log_every_n_steps=10,
        max_steps=60,
    ).fit(Logged())
    rows = read_csv(logger.experiment.metrics_file_path)
    theirs = {int(r["step"]) for r in rows if r.get("train_loss")}
    assert theirs == {9, 19, 29, 39, 49, 59}
    for key in ("amp/loss_scale", "amp/skip_rate", "amp/underflow_fraction", "amp/headroom_bits"):
        ours = {int(r["step"]) for r in rows if r.get(key)}
        assert theirs <= ours, key  # a join on `step` finds every one of Lightning's rows
    assert {int(r["step"]) for r in rows if r.get("amp/skip_rate")} == theirs  # and no logging point of its own


def test_a_collapse_logs_the_state_the_run_died_in_and_the_advise_command_says_so(tmp_path, capsys):
    from lightning_amp_plus import LossScaleCollapseError, NaNSkipReporter
    from lightning_amp_plus.__main__ import main

    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**16)
    with pytest.raises(LossScaleCollapseError):
        make_trainer(
            plugins=[plugin],
            callbacks=[LossScaleMonitor(), NaNSkipReporter(max_consecutive_skips=12, max_warnings=0)],
            logger=logger,
            log_every_n_steps=10,
            max_steps=100,
        ).fit(TinyModel(poison={s: "nan" for s in range(20, 40)}))
    assert plugin.history.last_step == 31  # 12 in a row from step 20: 37.5% of 32 updates
    rows = read_csv(logger.experiment.metrics_file_path)
    last = max(int(r["step"]) for r in rows)
    assert last == 31
    final = {k: v for r in rows if int(r["step"]) == 31 for k, v in r.items() if v}
    assert float(final["amp/skipped_steps"]) == 12.0
    assert float(final["amp/loss_scale"]) == plugin.history.scale_at(31) == 2.0**5  # not the last logging point's
    assert main(["advise", logger.log_dir]) == 0
    out = capsys.readouterr().out
    assert "looks healthy" not in out
    assert "[skip_rate] 12 of 32 updates were skipped (37.5%)" in out
    assert "the last 12 in a row, where the run ended" in out


def test_a_default_console_run_has_no_summary_warning_and_the_no_logger_warning_points_at_the_users_line():
    import warnings

    from lightning_amp_plus import AmpPlusWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed")],
            callbacks=[LossScaleMonitor()],
            enable_model_summary=True,
            max_steps=1,
        ).fit(TinyModel())  # the line the warning names
    assert not [w for w in caught if "not supported by the model summary" in str(w.message)]
    (no_logger,) = [w for w in caught if issubclass(w.category, AmpPlusWarning)]
    assert "has no logger" in str(no_logger.message)
    assert no_logger.filename == __file__
