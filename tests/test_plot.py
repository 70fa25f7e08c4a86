import struct
import subprocess
import sys

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter, plot_history
from lightning_amp_plus.__main__ import main
from lightning_amp_plus.plot import read_run
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
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics found" in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,1.0\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "LossScaleMonitor" in capsys.readouterr().err


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
