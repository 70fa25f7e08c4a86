"""The offline tools (``plot``, ``advise``) are true to the one run they read.

Runs are never merged: a folder holding several is refused with their list. The run's own plugin call, logged by
``LossScaleMonitor`` as a hyperparameter, makes each offline fix the run's call with one change. Every error names
the path it is about.
"""

import os

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_amp_plus import AmpAdvisor, AmpPlusFSDPPrecision, AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter
from lightning_amp_plus.__main__ import main
from lightning_amp_plus.advice import parse_plugin_call, plugin_call
from lightning_amp_plus.callbacks._common import plugin_arguments
from lightning_amp_plus.plot import read_logged, read_run
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Model(TinyModel):
    """A module with hyperparameters of its own: the monitor's must not push them out."""

    def __init__(self, poison=None, width=16):
        super().__init__(poison=poison)
        self.save_hyperparameters()


def _fit(logger, poison, steps=60, plugin=None, callbacks=()):
    plugin = plugin or AmpPlusPrecision("16-mixed", init_scale=2.0**12, growth_interval=20)
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=5), NaNSkipReporter(max_warnings=0), *callbacks],
        logger=logger,
        max_steps=steps,
    ).fit(Model(poison=poison))
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.flush()
    return plugin


def _two_runs(tmp_path, kind):
    """``lightning_logs/`` with version_0 (a skip at step 8) and version_1 (skips at 8 and 49)."""
    make = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind]
    plugins = [_fit(make(tmp_path, name="lightning_logs"), poison) for poison in ({8: "inf"}, {8: "inf", 49: "nan"})]
    return tmp_path / "lightning_logs", plugins


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_a_folder_of_several_runs_is_refused_with_the_list_to_pick_from(tmp_path, capsys, kind):
    parent, plugins = _two_runs(tmp_path, kind)
    runs = [str(parent / "version_0"), str(parent / "version_1")]
    for command in (["advise", str(parent)], ["plot", str(parent), "-o", str(tmp_path / "out.png")]):
        assert main(command) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no advice and no curve of a mixture
        assert captured.err.splitlines() == [
            f"error: {str(parent)!r} holds 2 runs: give one of them (runs are never merged):",
            *(f"  {run}" for run in runs),
        ]
    assert not (tmp_path / "out.png").exists()
    for run, plugin in zip(runs, plugins, strict=True):  # each run, given, is its own
        curves = read_run(run)
        assert curves.skipped == plugin.history.skipped_steps
        assert curves.scale[: len(plugin.history.curve())] == plugin.history.curve()
    assert plugins[0].history.skipped_steps != plugins[1].history.skipped_steps


def test_one_run_below_a_folder_is_read_and_named(tmp_path, capsys):
    plugin = _fit(CSVLogger(tmp_path, name="lightning_logs"), {8: "inf"})
    assert read_run(tmp_path).skipped == plugin.history.skipped_steps == [8]
    assert main(["advise", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"the one run at {tmp_path}: {tmp_path / 'lightning_logs' / 'version_0' / 'metrics.csv'}"
    assert main(["advise", str(tmp_path / "lightning_logs" / "version_0")]) == 0
    assert not capsys.readouterr().out.startswith("the one run at")  # the run itself: no need to name it


def test_tensorboard_event_files_of_two_fits_in_one_folder_are_refused(tmp_path, capsys):
    for poison in ({8: "inf"}, {30: "inf"}):  # the same version twice: two event files, both from step 0
        _fit(TensorBoardLogger(tmp_path, name="tb", version="fixed"), poison)
    folder = tmp_path / "tb" / "fixed"
    files = sorted(str(folder / f) for f in os.listdir(folder) if f.startswith("events.out.tfevents"))
    assert len(files) == 2
    assert main(["advise", str(folder)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"error: {str(folder)!r} holds 2 TensorBoard event files whose logged updates overlap (two fits into one"
        " folder): give one of them (runs are never merged):"
    )
    assert err[1:] == [f"  {f}" for f in files]
    assert read_run(files[1]).skipped == [30]  # each file is a run of its own


def test_tensorboard_event_files_that_continue_each_other_are_one_run(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for steps in (range(0, 10), range(10, 20)):  # a fit resumed into its own folder: a second file, later steps
        writer = SummaryWriter(tmp_path)
        for step in steps:
            writer.add_scalar("amp/loss_scale", 2.0 ** (step // 5), step)
        writer.close()
    assert len(os.listdir(tmp_path)) == 2
    assert read_run(tmp_path).scale == [(0, 1.0), (5, 2.0), (10, 4.0), (15, 8.0), (19, 8.0)]


def test_tensorboard_event_files_sharing_one_step_are_two_runs(tmp_path):
    """Issue 53: a second fit starting at the step the first ended overlaps it by one update (`<` merged them)."""
    from torch.utils.tensorboard import SummaryWriter

    for steps in (range(0, 11), range(10, 20)):
        writer = SummaryWriter(tmp_path)
        for step in steps:
            writer.add_scalar("amp/loss_scale", 2.0 ** (step // 5), step)
        writer.close()
    with pytest.raises(ValueError, match="whose logged updates overlap"):
        read_run(tmp_path)


def test_an_unbounded_max_scale_is_logged_and_advised_as_python(tmp_path):
    """``max_scale=float("inf")`` (torch's GradScaler exactly) once raised out of fit from the logged call."""
    plugin = AmpPlusPrecision("16-mixed", min_scale=0.0, max_scale=float("inf"))
    advisor = AmpAdvisor(print_advice=False)
    logger = CSVLogger(tmp_path, name="run")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(), advisor], logger=logger, max_steps=8).fit(
        TinyModel(grad_poison={0: "net.0.weight", 1: "net.0.weight"})
    )
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        logged = yaml.safe_load(f)["amp/plugin"]
    assert logged == 'AmpPlusPrecision("16-mixed", min_scale=0.0, max_scale=float("inf"))'
    assert parse_plugin_call(logged) == ("AmpPlusPrecision", {"precision": "16-mixed", **plugin_arguments(plugin)})
    (told,) = [a for a in advisor.advice if a.code == "init_scale"]  # the first two updates skipped: told
    assert 'max_scale=float("inf")' in told.fix
    fixed = eval(told.fix, {"AmpPlusPrecision": AmpPlusPrecision})  # pasted as printed
    assert fixed.scaler.max_scale == float("inf")


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_the_monitor_logs_the_plugins_call_beside_the_modules_own_hyperparameters(tmp_path, kind):
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12, growth_interval=20, fp32_modules=[torch.nn.ReLU])
    logger = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind](tmp_path, name="run")
    _fit(logger, {}, steps=5, plugin=plugin)
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        hparams = yaml.safe_load(f)
    relu = "torch.nn.modules.activation.ReLU"
    call = f'AmpPlusPrecision("16-mixed", init_scale=2.0**12, growth_interval=20, fp32_modules=["{relu}"])'
    assert hparams == {"amp/plugin": call, "poison": {}, "width": 16}  # the module's own kept beside it
    given = {"precision": "16-mixed", **plugin_arguments(plugin)}
    assert parse_plugin_call(hparams["amp/plugin"]) == ("AmpPlusPrecision", given)
    assert read_logged(logger.log_dir).hparams == hparams
    if kind == "tb":  # TensorBoard's HPARAMS tab shows the module's (its first summary), and no extra hp_metric
        from tensorboard.plugins.hparams import plugin_data_pb2

        acc = EventAccumulator(logger.log_dir)
        acc.Reload()
        content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        shown = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert set(shown) == {"width"}  # (an empty dict flattens to nothing)
        assert len(acc.Scalars("hp_metric")) == 1


def test_the_logged_call_reads_back_as_the_plugins_arguments():
    for plugin in (
        AmpPlusPrecision(),
        AmpPlusPrecision("bf16-mixed", "cpu", warn_skip_streak=None, fp32_modules=["head", "enc.*.attn"]),
        AmpPlusPrecision(init_scale=2.0**-3, growth_factor=1.5, min_scale=2.0**-20, hysteresis=2),
        AmpPlusPrecision(min_scale=0.0, max_scale=float("inf")),  # torch's GradScaler exactly: no bound
        AmpPlusPrecision(init_scale=np.float32(1024.0), warn_skip_streak=np.int64(20)),  # a sweep's NumPy scalars
        AmpPlusFSDPPrecision("16-mixed", param_dtype="float16", growth_interval=100),
    ):
        name = type(plugin).__name__
        call = plugin_call(name, plugin_arguments(plugin))
        assert parse_plugin_call(call) == (name, {"precision": plugin.precision, **plugin_arguments(plugin)}), call
        assert "np." not in call + repr(plugin)  # Python numbers, as a pasted fix reads them
        assert repr(plugin).startswith(name)
    refused = ("print(1)", 'AmpPlusPrecision("16-mixed", init_scale=__import__("os"))', "AmpPlusPrecision(**x)", 3)
    for text in (*refused, "AmpPlusPrecision(max_scale=float(1))"):
        assert parse_plugin_call(text) is None


@pytest.mark.parametrize("kind", ["csv", "tb"])
def test_the_offline_fix_is_the_runs_own_call_with_one_change(tmp_path, capsys, kind):
    """The main example's situation: the live advisor kept `growth_interval=100`; the offline one must too."""
    logger = {"csv": CSVLogger, "tb": TensorBoardLogger}[kind](tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)
    advisor = AmpAdvisor(print_advice=False)
    _fit(logger, {}, steps=30, plugin=plugin, callbacks=[advisor])  # the gradients overflow 2**24 to 2**17
    live = next(a.fix for a in advisor.advice if a.code == "init_scale")
    assert live == 'AmpPlusPrecision("16-mixed", init_scale=2.0**16, growth_interval=100)'
    capsys.readouterr()
    assert main(["advise", logger.log_dir]) == 0
    out = capsys.readouterr().out
    assert f"    fix: {live}\n" in out
    assert "note:" not in out


def test_a_run_without_the_logged_call_says_its_fix_shows_only_the_change(tmp_path, capsys):
    lines = ["step,amp/loss_scale,amp/skipped_steps"]
    lines += [f"{s},{2.0 ** max(24 - s, 20)},{min(s + 1, 4)}" for s in range(60)]
    (tmp_path / "metrics.csv").write_text("\n".join(lines) + "\n")
    assert main(["advise", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == '    fix: AmpPlusPrecision("16-mixed", init_scale=2.0**20)'
    assert out[-1] == (
        "note: the run's plugin call was not found in its hparams.yaml: each fix shows its one change; keep the other"
        " arguments you gave (`LossScaleMonitor` logs the call as `amp/plugin`)."
    )
    (tmp_path / "hparams.yaml").write_bytes(b"amp/plugin: \xe5\n")
    assert main(["advise", str(tmp_path)]) == 0
    assert f"hparams.yaml ({tmp_path / 'hparams.yaml'}: not UTF-8 text: byte 0xe5 at offset 12)" in (
        capsys.readouterr().out
    )


def _bad_inputs(tmp_path):
    """``{name: (path, what its error line says)}``: each a PATH the commands must refuse, naming it."""
    cases = {}

    def case(name, relative, why, content=None):
        path = tmp_path / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "folder":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        cases[name] = (str(path), why)

    case("missing", "nothing_here", "does not exist")
    case("empty", "folder", "no metrics found", "folder")
    case("not_utf8", "metrics.csv", "not UTF-8 text: byte 0xe5 at offset 26", b"step,amp/loss_scale\n0,8.0\n\xe5\n")
    case("no_series", "metrics.csv", "series found (keys: ['train_loss'])", "step,train_loss\n0,1.0\n")
    case(
        "no_step", "metrics.csv", "no `step` column (its columns: ['epoch', 'loss', 'acc'])", "epoch,loss,acc\n0,1,.5\n"
    )
    header = "its columns: ['step', 'amp/loss_scale'], none with a number at a step"
    case("header_only", "metrics.csv", header, "step,amp/loss_scale\n")  # a fit that stopped before its first log
    case("no_values", "metrics.csv", "its columns: ['step', 'val_loss'], none", "step,val_loss\n0,\n1,\n")
    case("empty_file", "metrics.csv", "the file is empty", "")
    case("ragged", "metrics.csv", "more fields than the header", "step,amp/loss_scale\n0,8.0\n1,4.0,7\n")
    case("not_a_scale", "metrics.csv", "at step 1 is -4.0: not a loss scale", "step,amp/loss_scale\n1,-4.0\n")
    case("text_file", "notes.txt", "no metrics found", "hello\n")
    case("several", "a/metrics.csv", "holds 2 runs", "step,amp/loss_scale\n0,8.0\n")
    (tmp_path / "several" / "b").mkdir()
    (tmp_path / "several" / "b" / "metrics.csv").write_text("step,amp/loss_scale\n0,4.0\n")
    cases["several"] = (str(tmp_path / "several"), cases["several"][1])
    return cases


@pytest.mark.parametrize("command", ["plot", "advise"])
def test_every_error_names_the_path_it_is_about(tmp_path, capsys, command):
    for name, (path, why) in _bad_inputs(tmp_path).items():
        argv = [command, path] + (["-o", str(tmp_path / "out.png")] if command == "plot" else [])
        assert main(argv) == 2, name
        captured = capsys.readouterr()
        first = captured.err.splitlines()[0]
        assert first.startswith("error: "), (name, first)
        assert path.rstrip("/") in first, (name, first)
        assert why in first, (name, first)
        if name != "several":
            assert len(captured.err.splitlines()) == 1, (name, captured.err)
    assert not (tmp_path / "out.png").exists()


def test_a_tensorboard_sub_dir_run_is_read_with_the_hparams_lightning_writes_beside_its_events(tmp_path, capsys):
    logger = TensorBoardLogger(tmp_path, name="tb", sub_dir="train")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)
    _fit(logger, {}, steps=30, plugin=plugin)
    events = tmp_path / "tb" / "version_0" / "train"
    assert (events / "hparams.yaml").exists()  # Lightning writes it in log_dir, the sub_dir included
    assert not (events.parent / "hparams.yaml").exists()
    run = read_logged(tmp_path / "tb")
    assert run.path == str(events)
    assert run.hparams["amp/plugin"] == 'AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)'
    assert main(["advise", str(tmp_path / "tb")]) == 0
    assert ", growth_interval=100)\n" in capsys.readouterr().out


def test_a_fit_resumed_into_its_own_tensorboard_folder_is_one_run(tmp_path):
    """Each fit's ``save_hyperparameters()`` writes ``hp_metric`` at step 0: the updates' series tell fits apart."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps, ckpt_path=None):
        plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**12, growth_interval=20)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=20)
        logger = TensorBoardLogger(tmp_path, name="tb", version="fixed")
        make_trainer(
            plugins=[plugin],
            callbacks=[LossScaleMonitor(logging_interval=5), NaNSkipReporter(max_warnings=0), checkpoint],
            logger=logger,
            max_steps=steps,
            enable_checkpointing=True,
        ).fit(Model(poison={8: "inf", 30: "inf"}), ckpt_path=ckpt_path)
        logger.experiment.flush()
        return plugin

    fit(20)
    resumed = fit(40, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    folder = tmp_path / "tb" / "fixed"
    files = sorted(f for f in os.listdir(folder) if f.startswith("events.out.tfevents"))
    assert len(files) == 2
    for name in files:  # both files hold the placeholder at step 0, as Lightning writes it
        acc = EventAccumulator(str(folder / name))
        acc.Reload()
        assert [e.step for e in acc.Scalars("hp_metric")] == [0]
    curves = read_run(folder)
    assert curves.skipped == resumed.history.skipped_steps == [8, 30]
    assert curves.scale[: len(resumed.history.curve())] == resumed.history.curve()


def test_an_hparams_file_with_lightnings_python_tags_is_read(tmp_path, capsys):
    """A tuple hyperparameter is written ``!!python/tuple`` (Lightning dumps with PyYAML's full dumper)."""

    class Sized(TinyModel):
        def __init__(self, poison=None, sizes=(16, 8)):
            super().__init__(poison=poison)
            self.save_hyperparameters()

    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=5)], logger=logger, max_steps=30).fit(
        Sized()
    )
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert "!!python/tuple" in f.read()
    run = read_logged(logger.log_dir)
    assert run.hparams_note is None
    assert run.hparams["sizes"] == [16, 8]
    assert run.hparams["amp/plugin"] == 'AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)'
    assert main(["advise", logger.log_dir]) == 0
    assert ", growth_interval=100)\n" in capsys.readouterr().out  # the fix is the run's own call with one change


def test_odd_files_and_names(tmp_path, capsys):
    """A CSV saved by a spreadsheet (a BOM, an upper-case extension); a folder whose name is not UTF-8."""
    lines = "step,amp/loss_scale,amp/skipped_steps\n0,1024,0\n3,512,1\n5,512,1\n"
    (tmp_path / "RUN.CSV").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    assert read_run(tmp_path / "RUN.CSV").skipped == [3]
    odd = os.path.join(os.fsencode(tmp_path), b"run-\xe5")
    os.makedirs(odd)
    with open(os.path.join(odd, b"metrics.csv"), "w") as f:
        f.write(lines)
    parent = tmp_path / "parent"
    os.makedirs(os.path.join(os.fsencode(parent), b"v\xe5"))
    os.rename(odd, os.path.join(os.fsencode(parent), b"v\xe5", b"run"))
    assert main(["advise", str(parent)]) == 0  # the one run below, its undecodable name escaped on stdout
    assert "\\udce5" in capsys.readouterr().out
    assert main(["plot", str(parent), "-o", str(tmp_path / "out.png")]) == 0
    assert main(["plot", os.fsdecode(os.path.join(os.fsencode(parent), b"v\xe5")), "-o", str(tmp_path / "x")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "x.png")


def test_an_hparams_file_with_a_python_tagged_mapping_is_read(tmp_path, capsys):
    """An ``argparse.Namespace`` hyperparameter is written ``!!python/object:argparse.Namespace``: read as a mapping."""
    import argparse

    class Configured(TinyModel):
        def __init__(self, args=None):
            super().__init__()
            self.save_hyperparameters()

    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=5)], logger=logger, max_steps=30).fit(
        Configured(args=argparse.Namespace(width=16, depth=2))
    )
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert "!!python/object:argparse.Namespace" in f.read()
    run = read_logged(logger.log_dir)
    assert run.hparams_note is None
    assert run.hparams["args"] == {"width": 16, "depth": 2}
    assert run.hparams["amp/plugin"] == 'AmpPlusPrecision("16-mixed", init_scale=2.0**24, growth_interval=100)'
    assert main(["advise", logger.log_dir]) == 0
    assert ", growth_interval=100)\n" in capsys.readouterr().out


def test_advise_on_a_bf16_runs_log_reads_its_skips_without_a_scale(tmp_path, capsys):
    logger = CSVLogger(tmp_path, name="bf16")
    make_trainer(
        plugins=[AmpPlusPrecision("bf16-mixed")],
        callbacks=[LossScaleMonitor(logging_interval=2), NaNSkipReporter(max_warnings=0, max_consecutive_skips=None)],
        logger=logger,
        max_steps=20,
        log_every_n_steps=2,
    ).fit(TinyModel(poison={s: "inf" for s in range(2, 20)}))
    assert main(["advise", logger.log_dir]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "1 finding from the logged series" in captured.out
    # the log starts at its first logging point (step 1): the monitor's counts say 20 updates, not the span's 19
    assert "[skip_rate] 18 of 20 updates were skipped (90.0%)" in captured.out
    # it had a NaNSkipReporter (its skips are logged): the fix is not to add one, but to read its origins live
    assert "fix: AmpAdvisor()  # live: it reads where each skip was born from the NaNSkipReporter" in captured.out
    assert "fix: NaNSkipReporter(" not in captured.out


def test_advise_on_a_log_whose_run_had_an_advisor_points_at_its_findings_not_at_adding_one(tmp_path, capsys):
    """Break pass: offline advise told a run that had an AmpAdvisor to add one; the live one had printed the fix."""
    logger = CSVLogger(tmp_path, name="bf16")
    make_trainer(
        plugins=[AmpPlusPrecision("bf16-mixed")],
        callbacks=[
            LossScaleMonitor(logging_interval=2),
            NaNSkipReporter(max_warnings=0, max_consecutive_skips=None),
            AmpAdvisor(print_advice=False),
        ],
        logger=logger,
        max_steps=20,
        log_every_n_steps=2,
    ).fit(TinyModel(poison={s: "inf" for s in range(2, 20)}))
    assert main(["advise", logger.log_dir]) == 0
    out = capsys.readouterr().out
    assert "[skip_rate] 18 of 20 updates were skipped (90.0%)" in out
    assert "fix: read the findings this run's AmpAdvisor printed at the end of fit" in out
    assert "fix: AmpAdvisor()" not in out


def test_advise_on_a_tensorboard_folder_without_scalars_is_one_error_line(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "tb"
    writer = SummaryWriter(str(folder))
    writer.add_text("note", "no scalar here", 0)
    writer.close()
    assert main(["advise", str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {folder}: no amp/ series found (keys: []); log them with `LossScaleMonitor`.\n"
