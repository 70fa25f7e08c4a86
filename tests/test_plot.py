import math
import os
import re
import struct
import subprocess
import sys

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter, plot_history
from lightning_amp_plus.__main__ import main
from lightning_amp_plus.plot import RunCurves, draw, read_run
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class LoggingModel(TinyModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def png_size(path):
    with open(path, "rb") as f:
        data = f.read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _run(tmp_path, logger):
    model = LoggingModel(poison={2: "inf", 6: "nan"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    monitor = [LossScaleMonitor(logging_interval=2)] if logger else []  # the monitor warns without a logger
    make_trainer(
        plugins=[plugin],
        callbacks=[*monitor, NaNSkipReporter(max_warnings=0)],
        logger=logger,
        max_steps=10,
        log_every_n_steps=2,
    ).fit(model)
    return plugin


def test_plot_from_csv_folder_and_file(tmp_path, capsys):
    logger = CSVLogger(tmp_path, name="csv")
    plugin = _run(tmp_path, logger)
    curves = read_run(logger.log_dir)
    assert curves.skipped == plugin.history.skipped_steps == [2, 6]
    assert curves.scale[: len(plugin.history.curve())] == plugin.history.curve()
    assert curves.loss  # the training loss was logged: second panel
    assert main(["plot", logger.log_dir, "-o", str(tmp_path / "out.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out.png")
    width, height = png_size(tmp_path / "out.png")
    assert width > 400
    assert height > 400
    assert main(["plot", logger.experiment.metrics_file_path]) == 0


def test_plot_from_tensorboard(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    plugin = _run(tmp_path, logger)
    logger.experiment.flush()
    curves = read_run(logger.log_dir)
    assert curves.skipped == [2, 6]
    assert curves.scale[: len(plugin.history.curve())] == plugin.history.curve()
    out = subprocess.run(
        [sys.executable, "-m", "lightning_amp_plus", "plot", logger.log_dir, "-o", str(tmp_path / "tb.png")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().endswith("tb.png")
    png_size(tmp_path / "tb.png")


def test_plot_history_from_code(tmp_path):
    plugin = _run(tmp_path, False)
    out = plot_history(plugin.history, tmp_path / "h.png")
    width, height = png_size(out)
    assert width > 400
    assert height < width


def test_clear_errors(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["plot", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"error: {str(missing)!r} does not exist: expected a CSVLogger version folder, a metrics.csv, a"
        " ScaleHistory.to_csv() file, or a TensorBoard log folder.\n"
    )
    (tmp_path / "empty").mkdir()  # a folder that exists but holds no metrics
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "error: no metrics found at" in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,1.0\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "LossScaleMonitor" in capsys.readouterr().err


def test_the_output_path_is_checked_before_drawing(tmp_path, capsys, monkeypatch):
    """``-o`` into a missing folder, into a file's "folder", or at a folder: one error line naming it, nothing made."""
    from lightning_amp_plus import plot

    (tmp_path / "metrics.csv").write_text("step,amp/loss_scale\n0,8.0\n3,4.0\n")
    monkeypatch.setattr(plot, "draw", lambda *a, **k: pytest.fail("drew before the output path was checked"))
    missing = tmp_path / "plots" / "run"
    cases = {
        str(missing / "out.png"): f"the folder {str(missing)!r} does not exist (create it first).",
        str(missing / "out"): f"the folder {str(missing)!r} does not exist (create it first).",
        str(tmp_path / "metrics.csv" / "out.png"): f"the folder {str(tmp_path / 'metrics.csv')!r} is not a folder.",
    }
    for out, why in cases.items():
        assert main(["plot", str(tmp_path), "-o", out]) == 2
        written = out if out.endswith(".png") else out + ".png"
        assert capsys.readouterr().err == f"error: cannot write the plot to {written!r}: {why}\n"
    assert not (tmp_path / "plots").exists()  # never created
    assert main(["plot", str(tmp_path), "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot write the plot to {str(tmp_path)!r}: it is a folder; give a file path such as"
        f" {str(tmp_path / 'loss_scale.png')!r}.\n"
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):  # from code too
        plot.plot_curves(RunCurves(scale=[(0, 8.0)]), missing / "out.png")
    monkeypatch.undo()
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "out")]) == 0  # an existing folder: written
    assert capsys.readouterr().out == f"{tmp_path / 'out.png'}\n"
    png_size(tmp_path / "out.png")


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    plugin = _run(tmp_path, False)
    with pytest.raises(ImportError, match=r"pip install 'lightning-amp-plus\[plot\]'"):
        plot_history(plugin.history, tmp_path / "x.png")


def _bf16_run(tmp_path, logger):
    model = LoggingModel(poison={2: "inf", 5: "nan"})
    plugin = AmpPlusPrecision("bf16-mixed")
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=2), NaNSkipReporter(max_warnings=0)],
        logger=logger,
        max_steps=8,
        log_every_n_steps=2,
    ).fit(model)
    return plugin


def test_bf16_logs_and_draws_no_loss_scale(tmp_path):
    from tests.callbacks.test_loss_scale_monitor import read_csv

    logger = CSVLogger(tmp_path, name="bf16")
    plugin = _bf16_run(tmp_path, logger)
    rows = read_csv(logger.experiment.metrics_file_path)
    keys = {k for r in rows for k, v in r.items() if v}
    assert not {k for k in keys if "loss_scale" in k or k in ("amp/growths", "amp/backoffs")}  # no scale exists
    assert {"amp/skipped_steps", "amp/skip_rate", "amp/applied_steps"} <= keys
    curves = read_run(logger.log_dir)
    assert curves.scaled is False
    assert curves.scale == []
    assert curves.skipped == plugin.history.skipped_steps == [2, 5]
    fig = draw(curves)
    try:
        (ax,) = fig.axes  # one panel: the loss with the skips on it; no 2**0 "loss scale"
        assert ax.get_yscale() == "linear"
        assert "no loss scale" in ax.get_title()
        (line,) = ax.lines
        assert [tuple(p) for p in line.get_xydata()] == [(float(s), v) for s, v in curves.loss]
        marks = ax.collections[0].get_offsets()

        def loss_at(step):  # the last logged (finite) loss at or before the skipped step
            return [v for s, v in curves.loss if s <= step][-1]

        assert [tuple(p) for p in marks] == [(2.0, loss_at(2)), (5.0, loss_at(5))]
    finally:
        fig.clf()
    history_fig = draw(RunCurves(skipped=plugin.history.skipped_steps, scaled=plugin.history.scaled))
    try:
        (line,) = history_fig.axes[0].lines  # no loss: the count of skipped updates
        assert [tuple(p) for p in line.get_xydata()] == [(0.0, 0.0), (2.0, 1.0), (5.0, 2.0), (5.0, 2.0)]
    finally:
        history_fig.clf()
    assert png_size(plot_history(plugin.history, tmp_path / "h.png"))[0] > 400
    assert main(["plot", logger.log_dir, "-o", str(tmp_path / "bf16.png")]) == 0


def test_the_scale_panel_draws_the_logged_curve(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    plugin = _run(tmp_path, logger)
    curves = read_run(logger.log_dir)
    fig = draw(curves)
    try:
        scale_ax, loss_ax = fig.axes
        assert scale_ax.get_yscale() == "log"
        steps = [s for s, _ in curves.scale]
        (line,) = scale_ax.lines
        drawn = [tuple(p) for p in line.get_xydata()]
        assert drawn[: len(steps)] == [(float(s), v) for s, v in curves.scale]
        assert [p[0] for p in scale_ax.collections[0].get_offsets()] == [2.0, 6.0]
        assert [p[1] for p in scale_ax.collections[0].get_offsets()] == [
            plugin.history.scale_at(2),
            plugin.history.scale_at(6),
        ]
    finally:
        fig.clf()


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_the_plot_command_imports_neither_torch_nor_lightning(tmp_path, kind):
    logger = CSVLogger(tmp_path, name="r") if kind == "csv" else TensorBoardLogger(tmp_path, name="r")
    _run(tmp_path, logger)
    if kind == "tensorboard":
        logger.experiment.flush()
    code = (
        "import sys\n"
        "from lightning_amp_plus.__main__ import main\n"
        f"assert main(['plot', {logger.log_dir!r}, '-o', {str(tmp_path / 'p.png')!r}]) == 0\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'torchmetrics', 'pytorch_lightning') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "heavy: []" in out.stdout
    png_size(tmp_path / "p.png")


def test_a_clean_bf16_run_draws_its_skip_count(tmp_path):
    plugin = AmpPlusPrecision("bf16-mixed")
    logger = CSVLogger(tmp_path, name="clean")
    make_trainer(plugins=[plugin], callbacks=[LossScaleMonitor(logging_interval=2)], logger=logger, max_steps=4).fit(
        TinyModel()
    )
    curves = read_run(logger.log_dir)
    assert (curves.scaled, curves.skipped, curves.last_step) == (False, [], 3)
    fig = draw(curves)
    try:
        (line,) = fig.axes[0].lines
        assert [tuple(p) for p in line.get_xydata()] == [(0.0, 0.0), (3.0, 0.0)]
    finally:
        fig.clf()
    assert png_size(plot_history(plugin.history, tmp_path / "h.png"))[0] > 400


def test_a_16_mixed_run_with_the_reporter_alone_is_not_read_as_bf16(tmp_path, capsys):
    logger = CSVLogger(tmp_path, name="nsr")
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[NaNSkipReporter(max_warnings=0)],
        logger=logger,
        max_steps=4,
    ).fit(TinyModel(poison={1: "inf"}))
    assert main(["plot", logger.log_dir]) == 2
    assert "LossScaleMonitor" in capsys.readouterr().err


def test_tensorboard_non_finite_values_are_dropped_as_in_csv(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    _bf16_run(tmp_path, logger)
    logger.experiment.flush()
    curves = read_run(logger.log_dir)
    assert curves.scaled is False
    assert all(math.isfinite(v) for _, v in curves.loss)
    assert curves.skipped == [2, 5]


def test_a_saved_bf16_history_stays_unscaled():
    from lightning_amp_plus import ScaleHistory

    plugin = _bf16_run_history()
    state = plugin.history.state_dict()
    assert state["scaled"] is False
    loaded = ScaleHistory()
    loaded.load_state_dict(state)
    assert loaded.scaled is False
    with pytest.raises(ValueError, match=r"\['scaled'\]=1"):
        ScaleHistory().load_state_dict({**state, "scaled": 1})


def _bf16_run_history():
    plugin = AmpPlusPrecision("bf16-mixed")
    make_trainer(plugins=[plugin], max_steps=3).fit(TinyModel(poison={1: "nan"}))
    return plugin


def test_what_plot_history_draws():
    from lightning_amp_plus import ScaleHistory
    from lightning_amp_plus.plot import history_curves

    history = ScaleHistory()
    for step, (scale, found) in enumerate([(8.0, 0), (8.0, 1), (4.0, 0), (4.0, 0)]):
        history.record(step, scale, float(found))
    curves = history_curves(history, loss=[(0, 1.0), (3, 0.5)])
    assert (curves.scale, curves.skipped, curves.loss, curves.scaled, curves.last_step) == (
        [(0, 8.0), (2, 4.0), (3, 4.0)],  # held to the last recorded step
        [1],
        [(0, 1.0), (3, 0.5)],
        True,
        3,
    )
    history.record(4, 8.0, 0.0)  # a change at the last step: nothing appended
    assert history_curves(history).scale == [(0, 8.0), (2, 4.0), (4, 8.0)]
    bf16 = ScaleHistory(scaled=False)
    bf16.record(0, 1.0, 1.0)
    assert (history_curves(bf16).scale, history_curves(bf16).scaled) == ([], False)


def test_the_png_size_and_title(tmp_path):
    from lightning_amp_plus.plot import plot_curves, plot_run

    one = plot_curves(RunCurves(scale=[(0, 2.0), (5, 4.0)]), tmp_path / "one")
    assert one == str(tmp_path / "one.png")  # the extension added, and said
    assert png_size(one) == (880, 352)  # 8 x 3.2 inches at 110 dpi
    two = plot_curves(RunCurves(scale=[(0, 2.0)], loss=[(0, 1.0), (1, 0.5)]), tmp_path / "two.png")
    assert png_size(two) == (880, 704)  # a second panel for the loss
    fig = draw(RunCurves(scale=[(0, 2.0)], skipped=[0]), title="my run")
    try:
        assert fig.axes[0].get_title() == "my run"
        assert fig.axes[0].get_legend().get_texts()[0].get_text() == "loss scale"
        assert fig.axes[0].get_legend().get_texts()[1].get_text() == "skipped (1)"
    finally:
        fig.clf()
    logger = CSVLogger(tmp_path, name="csv")
    _run(tmp_path, logger)
    out = plot_run(logger.log_dir)
    assert out == os.path.join(logger.log_dir, "loss_scale.png")  # beside the metrics by default
    out = plot_run(logger.experiment.metrics_file_path)
    assert out == os.path.join(logger.log_dir, "loss_scale.png")


def test_a_tensorboard_parent_folder_is_read_recursively(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    plugin = _run(tmp_path, logger)
    logger.experiment.flush()
    curves = read_run(tmp_path / "tb")  # the folder above version_0
    assert curves.skipped == plugin.history.skipped_steps == [2, 6]


def test_the_command_line_help(monkeypatch):
    import contextlib
    import io

    def help_of(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0
        return out.getvalue()

    def rows(text):  # each help line as its columns: ("plot", "plot the loss-scale curve ...")
        return {tuple(re.split(r"\s{2,}", line.strip())) for line in text.splitlines() if line.strip()}

    monkeypatch.setenv("COLUMNS", "200")  # one line per help text
    top = help_of()
    assert top.startswith("usage: lightning-amp-plus [-h] [--version] COMMAND ...")
    plot_help = "draw the loss-scale curve and the skipped updates of the run at PATH to a PNG (-o OUT.png)"
    advise_help = "what the series logged at PATH say went wrong, and the fix (AmpAdvisor's offline half)"
    assert ("plot", plot_help) in rows(top)
    assert ("advise", advise_help) in rows(top)
    # each command listed once: no hand-written list beside argparse's own
    named = [line.split()[0] for line in top.splitlines() if line.strip() and line.split()[0] in ("plot", "advise")]
    assert named == ["plot", "advise"]
    assert top.count("plot") == 1 + top.count("lightning-amp-plus plot")  # the listing, then the examples
    folder = "a CSVLogger version folder, a metrics.csv, a ScaleHistory.to_csv() file, or a TensorBoard log folder"
    assert f"PATH is {folder}." in top
    plot = help_of("plot")
    assert plot.startswith("usage: lightning-amp-plus plot [-h] [-o OUTPUT] path")
    assert ("path", folder) in rows(plot)
    # under "-o OUTPUT, --output OUTPUT"
    assert ("the PNG to write, in a folder that exists (default: loss_scale.png beside PATH)",) in rows(plot)
    advise = help_of("advise")
    assert advise.startswith("usage: lightning-amp-plus advise [-h] path")
    assert ("path", folder) in rows(advise)
    with pytest.raises(SystemExit) as done:
        main([])  # a command is required
    assert done.value.code == 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--version"])
    assert out.getvalue().strip().startswith("lightning-amp-plus 0.")


def test_plot_history_draws_the_given_loss_and_extends_the_last_scale(tmp_path, monkeypatch):
    from lightning_amp_plus import ScaleHistory, plot

    history = ScaleHistory()
    for step, (scale, found) in enumerate([(8.0, 0.0), (8.0, 1.0), (4.0, 0.0), (8.0, 0.0), (8.0, 0.0)]):
        history.record(step, scale, found)
    drawn = []
    monkeypatch.setattr(plot, "plot_curves", lambda curves, output: drawn.append(curves) or str(output))
    loss = [(0, 1.0), (4, 0.5)]
    assert plot_history(history, tmp_path / "x.png", loss=loss) == str(tmp_path / "x.png")
    (curves,) = drawn
    assert curves.loss == loss
    assert curves.scale == [(0, 8.0), (2, 4.0), (3, 8.0), (4, 8.0)]  # the last value held to the last step
    assert curves.skipped == [1]


def test_tensorboard_is_read_whole_beside_other_files(tmp_path):
    """Every point of a long run (TensorBoard's reader keeps 10,000 scalars per tag unless told otherwise), from
    the event files only."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_amp_plus.plot import read_series

    writer = SummaryWriter(tmp_path / "version_0")
    for step in range(10_050):
        writer.add_scalar("amp/loss_scale", 2.0 ** (step % 7), step)
    writer.close()
    (tmp_path / "version_0" / "hparams.yaml").write_text("lr: 0.1\n")
    series = read_series(tmp_path)
    assert list(series) == ["amp/loss_scale"]
    assert len(series["amp/loss_scale"]) == 10_050
    assert series["amp/loss_scale"][-1] == (10_049, 2.0 ** (10_049 % 7))


def _describe_figure(fig):
    """Everything a reader sees in ``fig``, as plain values: per panel its labels, scale, grid, legend and artists."""
    from matplotlib.colors import to_hex
    from matplotlib.markers import MarkerStyle

    x = MarkerStyle("x")
    x_marker = x.get_path().transformed(x.get_transform()).vertices.tolist()
    panels = []
    for ax in fig.axes:
        legend = ax.get_legend()
        panels.append(
            {
                "title": ax.get_title(),
                "ylabel": ax.get_ylabel(),
                "xlabel": ax.get_xlabel(),
                "yscale": ax.get_yscale(),
                "log_base": getattr(ax.yaxis.get_transform(), "base", None),
                "grid": [ax.xaxis.get_gridlines()[0].get_visible(), ax.xaxis.get_gridlines()[0].get_alpha()],
                "minor_grid": ax.yaxis._minor_tick_kw.get("gridOn", False),  # which="both" (matplotlib keeps it here)
                "legend": None if legend is None else [t.get_text() for t in legend.get_texts()],
                "lines": [
                    {
                        "x": [float(v) for v in line.get_xdata()],
                        "y": [float(v) for v in line.get_ydata()],
                        "color": to_hex(line.get_color()),
                        "drawstyle": line.get_drawstyle(),
                        "label": line.get_label(),
                    }
                    for line in ax.get_lines()
                ],
                "marks": [
                    {
                        "at": c.get_offsets().tolist(),
                        "color": to_hex(c.get_facecolor()[0] if len(c.get_facecolor()) else c.get_edgecolor()[0]),
                        "x_marker": c.get_paths()[0].vertices.tolist() == x_marker,
                        "zorder": c.get_zorder(),
                        "label": c.get_label(),
                    }
                    for c in ax.collections
                ],
            }
        )
    shared = len(fig.axes) < 2 or fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])
    return {"size": [float(v) for v in fig.get_size_inches()], "shared_x": shared, "panels": panels}


BLUE, RED, GREEN = "#1f77b4", "#d62728", "#2ca02c"  # matplotlib's tab:blue, tab:red, tab:green


def test_the_figure_item_by_item():
    """16-mixed with a loss: the scale panel (log2 step curve held to the last step, skips marked on it) over the
    loss panel, x shared; bf16 with a loss: the loss with the skips on it; bf16 without: the skip count."""
    fig = draw(RunCurves(scale=[(0, 8.0), (2, 4.0)], skipped=[1], loss=[(0, 3.0), (5, 1.0)], last_step=6), "run")
    scale, loss = _describe_figure(fig)["panels"]
    assert _describe_figure(fig)["size"] == [8.0, 6.4]
    assert _describe_figure(fig)["shared_x"] is True
    assert scale == {
        "title": "run",
        "ylabel": "loss scale (log2)",
        "xlabel": "",
        "yscale": "log",
        "log_base": 2,
        "grid": [True, 0.3],
        "minor_grid": True,
        "legend": ["loss scale", "skipped (1)"],
        "lines": [{"x": [0, 2, 6], "y": [8, 4, 4], "color": BLUE, "drawstyle": "steps-post", "label": "loss scale"}],
        "marks": [{"at": [[1.0, 8.0]], "color": RED, "x_marker": True, "zorder": 3, "label": "skipped (1)"}],
    }
    assert loss["ylabel"] == "training loss"
    assert loss["xlabel"] == "logger step"  # the x values are the steps the logger wrote
    assert loss["grid"] == [True, 0.3]
    assert loss["lines"] == [{"x": [0, 5], "y": [3, 1], "color": GREEN, "drawstyle": "default", "label": "_child0"}]

    (bf16,) = _describe_figure(draw(RunCurves(skipped=[2], loss=[(0, 3.0), (4, 1.0)], scaled=False)))["panels"]
    assert bf16["title"] == "loss scale (bf16-mixed: no loss scale)"
    assert bf16["ylabel"] == "training loss"
    assert bf16["yscale"] == "linear"
    assert bf16["legend"] == ["training loss", "skipped (1)"]
    assert bf16["lines"] == [
        {"x": [0, 4], "y": [3, 1], "color": GREEN, "drawstyle": "default", "label": "training loss"}
    ]
    assert bf16["marks"] == [{"at": [[2.0, 3.0]], "color": RED, "x_marker": True, "zorder": 3, "label": "skipped (1)"}]

    (count,) = _describe_figure(draw(RunCurves(skipped=[2, 5], scaled=False, last_step=7)))["panels"]
    assert count["title"] == "loss scale (bf16-mixed: no loss scale)"
    assert count["ylabel"] == "skipped updates"
    assert count["xlabel"] == "logger step"
    assert count["grid"] == [True, 0.3]
    assert count["lines"] == [
        {"x": [0, 2, 5, 7], "y": [0, 1, 2, 2], "color": RED, "drawstyle": "steps-post", "label": "skipped (2)"}
    ]


def test_the_logged_scale_series_rules_shared_by_plot_and_advise(tmp_path):
    """One rule reads a logged scale: change points, a float32 scale's range (both ends allowed), the last value held
    to the last logged step; the plot and the advise command both use it."""
    from lightning_amp_plus._limits import FLOAT32_MAX, FLOAT32_TINY
    from lightning_amp_plus._series import held, scale_changes, value_at
    from lightning_amp_plus.advice import figures_from_series
    from lightning_amp_plus.plot import _from_series

    tiny = FLOAT32_TINY / 2**23  # float32's smallest subnormal: a stock scaler that collapsed logs such values
    ends = {"amp/loss_scale": [(0, FLOAT32_MAX), (1, FLOAT32_MAX), (2, tiny)]}
    assert scale_changes(ends, "amp/loss_scale") == [(0, FLOAT32_MAX), (2, tiny)]
    assert _from_series(ends).scale == [(0, FLOAT32_MAX), (2, tiny)]  # the last point is a change: no copy
    assert figures_from_series(ends).curve == [(0, FLOAT32_MAX), (2, tiny)]
    kept = {"amp/loss_scale": [(0, 8.0), (3, 4.0), (4, 4.0), (9, 4.0)]}
    assert _from_series(kept).scale == [(0, 8.0), (3, 4.0), (9, 4.0)]
    for bad in (FLOAT32_MAX * 2, float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match=r"^amp/loss_scale at step 1 is .*: not a loss scale \(expected a float32"):
            scale_changes({"amp/loss_scale": [(0, 8.0), (1, bad)]}, "amp/loss_scale")
        with pytest.raises(ValueError, match=r"^amp/loss_scale at step 1 is"):
            figures_from_series({"amp/loss_scale": [(0, 8.0), (1, bad)]})
    assert value_at([(3, 4.0), (5, 2.0)], 1) == 4.0  # before the first change point: the first value
    assert held([], 5) == []
    assert held([(0, 8.0)], None) == [(0, 8.0)]
    assert held([(0, 8.0), (2, 4.0)], 2) == [(0, 8.0), (2, 4.0)]
    assert held([(0, 8.0), (2, 4.0)], 3) == [(0, 8.0), (2, 4.0), (3, 4.0)]
    keys = {f"k{i:02d}": [(0, 1.0)] for i in range(12)}
    with pytest.raises(ValueError, match="no loss-scale series found") as err:
        _from_series(keys)
    assert str(err.value) == (
        f"no loss-scale series found (keys: {[f'k{i:02d}' for i in range(10)]}); log it with `LossScaleMonitor`."
    )


def test_read_series_says_what_it_expected_where_nothing_is(tmp_path):
    from lightning_amp_plus.plot import read_series

    (tmp_path / "hparams.yaml").write_text("lr: 0.1\n")  # a folder with neither metrics.csv nor event files
    with pytest.raises(FileNotFoundError, match=r"^no metrics found at .*: expected a CSVLogger version folder"):
        read_series(tmp_path)
    for missing in (tmp_path / "missing.csv", tmp_path / "missing"):  # a path that does not exist says so
        with pytest.raises(FileNotFoundError) as err:
            read_series(missing)
        assert str(err.value) == (
            f"{str(missing)!r} does not exist: expected a CSVLogger version folder, a metrics.csv, a"
            " ScaleHistory.to_csv() file, or a TensorBoard log folder."
        )


def test_csv_columns_steps_and_the_titles_a_plot_gets(tmp_path, monkeypatch):
    from lightning_amp_plus import plot
    from lightning_amp_plus.plot import plot_curves, plot_run, read_series

    (tmp_path / "metrics.csv").write_text(
        "step,epoch,amp/loss_scale,note,train_loss\n0,0,8.0,a,1.5\n1,0,8.0,,inf\n2,1,4.0,b,\n"
    )
    series = read_series(tmp_path / "metrics.csv")
    assert series == {"amp/loss_scale": [(0, 8.0), (1, 8.0), (2, 4.0)], "train_loss": [(0, 1.5)]}  # no epoch, no text
    for bad, why in (("1.5", "is not a step index"), ("-1", "is not a step index"), ("inf", "is not a step index")):
        (tmp_path / "bad.csv").write_text(f"step,amp/loss_scale\n{bad},8.0\n")
        with pytest.raises(ValueError, match=rf"bad\.csv: step '{re.escape(bad)}' {why} \(expected an int >= 0\)\.$"):
            read_series(tmp_path / "bad.csv")
    titles = []
    real_draw = plot.draw
    monkeypatch.setattr(
        plot, "draw", lambda curves, title="loss scale": titles.append(title) or real_draw(curves, title)
    )
    plot_curves(RunCurves(scale=[(0, 8.0)]), tmp_path / "a.png", title="mine")
    plot_run(tmp_path, tmp_path / "b.png")
    assert titles == ["mine", f"loss scale: {tmp_path}"]


def test_an_event_file_itself_is_read_as_its_folder(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from lightning_amp_plus.plot import read_series

    writer = SummaryWriter(tmp_path)
    writer.add_scalar("amp/loss_scale", 8.0, 0)
    writer.close()
    (events,) = tmp_path.glob("events.out.tfevents*")
    assert read_series(events) == {"amp/loss_scale": [(0, 8.0)]}
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no metrics found"):
        read_series(tmp_path / "other.txt")


def test_the_underflow_and_headroom_get_a_panel_between_the_scale_and_the_loss(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_amp_plus import GradUnderflowMonitor

    logger = CSVLogger(tmp_path, name="csv")
    model = LoggingModel()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=2), GradUnderflowMonitor(every_n_steps=2, max_warnings=0)],
        logger=logger,
        max_steps=10,
        log_every_n_steps=2,
    ).fit(model)
    curves = read_run(logger.log_dir)
    assert [s for s, _ in curves.underflow] == [s for s, _ in curves.headroom] == [1, 3, 5, 7, 9]
    fig = draw(curves)
    try:
        scale, gradients, loss, headroom = fig.axes  # the headroom's own axis, on the right, last
        assert [scale.get_ylabel(), gradients.get_ylabel(), loss.get_ylabel()] == [
            "loss scale (log2)",
            "underflow fraction",
            "training loss",
        ]
        assert headroom.get_ylabel() == "headroom (bits)"
        assert [list(line.get_xdata()) for line in gradients.get_lines()] == [[1, 3, 5, 7, 9]]
        assert list(headroom.get_lines()[0].get_ydata()) == [v for _, v in curves.headroom]
        assert [t.get_text() for t in gradients.get_legend().get_texts()] == ["underflow fraction", "headroom (bits)"]
    finally:
        fig.clf()
