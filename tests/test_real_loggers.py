"""The loggers people use, for real: MLflow (a SQLite tracking store) and W&B (offline) get what CSVLogger gets.

Each run logs to a ``CSVLogger`` and to the logger under test in the same ``Trainer``; losses multiplied by inf or
nan on chosen batches make skips. Every ``amp/`` series (the scale curve, the skips, the counts) and the training
loss must reach both loggers with the same values at the same steps, and the scale curve and skipped steps read
back from either must be the plugin's own history.
"""

import csv
import glob
import json
import math
import os
import struct
import sys
import time
import zlib

import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter
from lightning_amp_plus._series import scale_changes, skipped_steps
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

POISON = {3: "inf", 4: "inf", 11: "nan", 17: "inf"}
#: what LossScaleMonitor and NaNSkipReporter log in a 16-mixed run (the progress bar's amp/scale and amp/skipped
#: are not logger metrics)
AMP_KEYS = {
    "amp/loss_scale",
    "amp/log2_loss_scale",
    "amp/skipped_steps",
    "amp/skip_rate",
    "amp/growths",
    "amp/backoffs",
    "amp/applied_steps",
    "amp/step_skipped",
    "amp/consecutive_skips",
}


class LoggingModel(TinyModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


#: what `LossScaleMonitor` logs as the hyperparameter `amp/plugin` for `_fit`'s plugin
PLUGIN_CALL = 'AmpPlusPrecision("16-mixed", device="cpu", init_scale=2.0**10, growth_interval=4)'


def _fit(logger):
    plugin = AmpPlusPrecision("16-mixed", "cpu", init_scale=1024.0, growth_interval=4)
    trainer = make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), NaNSkipReporter(max_warnings=0)],
        logger=logger,
        max_steps=20,
        log_every_n_steps=5,
    )
    trainer.fit(LoggingModel(poison=POISON))
    assert plugin.history.skipped_steps == sorted(POISON)
    return plugin


def _csv_series(logger):
    """``{key: sorted [(step, value)]}`` of a CSVLogger run (every value written, row by row)."""
    series = {}
    with open(logger.experiment.metrics_file_path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value != "":
                    series.setdefault(key, []).append((int(row["step"]), float(value)))
    return {key: sorted(points) for key, points in series.items()}


def _check_same_as_csv(series, csv_series, plugin, stored=float):
    assert set(csv_series) >= AMP_KEYS
    wanted = {k for k in csv_series if k.startswith("amp/")} | {"train_loss"}
    assert {k for k in series if k.startswith("amp/")} | {"train_loss"} == wanted
    for key in sorted(wanted):
        assert series[key] == [(s, stored(v)) for s, v in csv_series[key]], key  # the same values at the same steps
    assert scale_changes(series, "amp/loss_scale") == plugin.history.curve()
    assert skipped_steps(series, "amp/") == plugin.history.skipped_steps
    # the counts at the run's last step: 4 skips of 20 updates
    assert series["amp/skipped_steps"][-1] == (19, 4.0)
    assert series["amp/applied_steps"][-1] == (19, 16.0)
    assert max(v for _, v in series["amp/consecutive_skips"]) == 2.0  # steps 3 and 4


def test_mlflow_with_a_sqlite_store_gets_what_csv_gets(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow_logger = MLFlowLogger(experiment_name="amp", tracking_uri=uri, save_dir=str(tmp_path / "mlruns"))
    csv_logger = CSVLogger(tmp_path, name="csv")
    plugin = _fit([csv_logger, mlflow_logger])

    client = MlflowClient(tracking_uri=uri)  # a new client reads the database back
    run = client.get_run(mlflow_logger.run_id)
    assert run.data.params["amp/plugin"] == PLUGIN_CALL  # the plugin's call, as a param
    series = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    # MLflow's SQL store keeps an infinite value (the poisoned loss logged at step 4) as the largest float
    _check_same_as_csv(
        series,
        _csv_series(csv_logger),
        plugin,
        stored=lambda v: math.copysign(sys.float_info.max, v) if math.isinf(v) else v,
    )


def test_wandb_offline_gets_what_csv_gets(tmp_path, monkeypatch):
    import wandb

    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)
    wandb_logger = WandbLogger(project="amp", save_dir=str(tmp_path), offline=True)
    csv_logger = CSVLogger(tmp_path, name="csv")
    plugin = _fit([csv_logger, wandb_logger])
    wandb_logger.experiment.finish()  # the run file is complete once the run is finished
    assert wandb.run is None

    (run_file,) = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    records = _wandb_run(run_file)
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["amp/plugin"] == PLUGIN_CALL  # the plugin's call, in the run's config
    series = {}
    for row in _wandb_history(records):
        step = row.pop("trainer/global_step")  # WandbLogger logs Lightning's step beside the metrics
        for key, value in row.items():
            if not key.startswith("_") and key != "epoch":
                series.setdefault(key, []).append((step, float(value)))
    _check_same_as_csv({key: sorted(points) for key, points in series.items()}, _csv_series(csv_logger), plugin)


# W&B writes a run as a LevelDB-style log of protobuf records (wandb's own reader, `wandb.sdk.internal.datastore`,
# is gone from recent releases): a 7-byte file header, then 32 KiB blocks of chunks, each with its CRC-32 (of the
# chunk's type byte and data), its length and its type; a record longer than a block's rest spans several chunks.
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path):
    """The serialized records of a ``.wandb`` run file, each checked against its CRC."""
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if pos + _HEADER + length > len(data):
            return  # a chunk still being written
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: a damaged record at byte {pos}"
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        else:
            assert kind == _LAST, kind
            yield pending + chunk


def _wandb_run(path, timeout=60.0):
    """The records of a finished W&B run file (``wandb_internal_pb2.Record``).

    ``run.finish()`` can return before wandb's writer process has flushed the file: it is read again until it
    holds the run's ``exit`` record, the last one written.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        records = []
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)
    return records


def _wandb_history(records):
    """Each ``run.log`` row of a W&B run's records, as a dict (``_step``, ``_runtime``, ... included)."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]


def test_the_wandb_reader_takes_records_across_blocks(tmp_path):
    """The reader itself: a record split over blocks comes back whole, a damaged one is refused."""

    def chunk(kind, payload):
        return struct.pack("<IHB", zlib.crc32(bytes([kind]) + payload), len(payload), kind) + payload

    big = bytes(range(256)) * 300  # 76,800 bytes: a first chunk to its block's end, a whole block, a last chunk
    first = _BLOCK - 3 * _HEADER - 10
    second = _BLOCK - _HEADER
    data = struct.pack("<4sHB", b":W&B", 0xBEE1, 0) + chunk(_FULL, b"0123456789")
    data += chunk(_FIRST, big[:first]) + chunk(_MIDDLE, big[first : first + second])
    data += chunk(_LAST, big[first + second :])
    path = tmp_path / "run.wandb"
    path.write_bytes(data)
    assert list(_wandb_records(path)) == [b"0123456789", big]
    path.write_bytes(data[:20] + b"X" + data[21:])
    with pytest.raises(AssertionError, match="a damaged record"):
        list(_wandb_records(path))
