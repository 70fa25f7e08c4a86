import warnings

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import AmpPlusPrecision, GradUnderflowMonitor
from lightning_amp_plus.syncs import HostSyncCounter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class TinyGrads(TinyModel):
    """True gradients around 1e-9: below float16's 2**-24 unless scaled up."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-9


def _measure(init_scale, **kwargs):
    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=init_scale, min_scale=min(1.0, init_scale), **kwargs)
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=4).fit(model)
    return monitor


def test_underflow_high_at_scale_one_and_low_at_scale_2_16():
    low_scale = _measure(1.0)
    high_scale = _measure(2.0**16)
    assert all(m["underflow_fraction"] > 0.9 for m in low_scale.measurements)
    assert all(m["underflow_fraction"] < 0.3 for m in high_scale.measurements)  # what is left: ReLU zeros
    assert len(high_scale.measurements[0]["worst"]) == 2


def test_headroom_falls_as_the_scale_grows():
    monitor = _measure(2.0**10, growth_interval=1, max_scale=2.0**20)
    scales = [m["scale"] for m in monitor.measurements]
    headroom = [m["headroom_bits"] for m in monitor.measurements]
    assert scales == [2.0**10, 2.0**11, 2.0**12, 2.0**13]
    assert all(a > b for a, b in zip(headroom, headroom[1:], strict=False))  # falls at every doubling
    assert headroom[0] - headroom[-1] == pytest.approx(3.0, abs=0.5)  # about one bit per doubling


def test_warns_when_underflow_stays_high_at_min_scale():
    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=2)
    with pytest.warns(UserWarning, match=r"underflow float16 while the loss scale sits at min_scale=1.*HINT"):
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=3).fit(model)


def test_logged_and_measured_only_every_n_steps(tmp_path):
    logger = CSVLogger(tmp_path)
    monitor = GradUnderflowMonitor(every_n_steps=3)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], logger=logger, max_steps=7
    ).fit(TinyModel())
    assert [m["step"] for m in monitor.measurements] == [0, 3, 6]
    with open(logger.experiment.metrics_file_path) as f:
        text = f.read()
    assert "amp/underflow_fraction" in text
    assert "amp/headroom_bits" in text


def test_one_host_transfer_per_measurement():
    def syncs(monitor):
        model = TinyModel()
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        callbacks = [monitor] if monitor else []
        trainer = make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=8)
        with HostSyncCounter() as counter:
            trainer.fit(model)
        return counter.count

    # TinyModel reads its loss once a step; the monitor adds exactly its 2 measurements (steps 0 and 4)
    assert syncs(GradUnderflowMonitor(every_n_steps=4)) - syncs(None) == 2


def test_bf16_warns_and_measures_nothing():
    monitor = GradUnderflowMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="with bf16-mixed there is no scaler"):
        make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[monitor], max_steps=2).fit(TinyModel())
    assert monitor.measurements == []
