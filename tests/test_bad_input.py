"""Bad input and faults (issue: never NaN in the weights, never a masked error, never a silent wrong state)."""

import json
import math
import os
import re

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_amp_plus import (
    AmpPlusFabricPrecision,
    AmpPlusPrecision,
    AmpPlusWarning,
    DynamicLossScaler,
    GradUnderflowMonitor,
    LossScaleCollapseError,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from lightning_amp_plus.__main__ import main as cli
from lightning_amp_plus.knobs import DEFAULTS
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer


# ---------------------------------------------------------------------------------------------- 4: reporter resume
def test_reporter_continues_a_streak_across_resume(tmp_path):
    def run(ckpt_path=None):
        model = TinyModel(poison={s: "inf" for s in (8, 9, 10, 11)})
        plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**16, min_scale=2.0**-10)
        reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
        trainer = make_trainer(
            plugins=[plugin],
            callbacks=[reporter, saver],
            max_steps=14,
            enable_checkpointing=True,
            logger=CSVLogger(tmp_path, name="run"),
        )
        with pytest.raises(LossScaleCollapseError, match="3 consecutive optimizer steps were skipped"):
            trainer.fit(model, ckpt_path=ckpt_path)
        return trainer, reporter

    trainer, reporter = run()
    assert trainer.global_step == 10  # stopped inside step 10, the 3rd skip in a row
    assert reporter.skipped_steps == [8, 9, 10]
    # resumed after step 9 (two skips in a row so far): step 10 is still the 3rd
    resumed, again = run(ckpt_path=tmp_path / "epoch=0-step=10.ckpt")
    assert resumed.global_step == 10
    assert again.skipped_steps == [8, 9, 10]
    assert again.num_skips == 3


# ---------------------------------------------------------------------------------------------- 5: report_path
@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        ("", ValueError, r"`NaNSkipReporter\(report_path=''\)` is invalid: expected a non-empty file path"),
        (
            42,
            TypeError,
            r"^`NaNSkipReporter\(report_path=42\)` is invalid: expected a file path \(str or os\.PathLike\) or None,"
            r" got int\.$",
        ),
    ],
)
def test_report_path_type_is_checked_at_construction(path, error, match):
    with pytest.raises(error, match=match):
        NaNSkipReporter(report_path=path)


def test_report_path_that_cannot_be_written_is_an_error_at_setup(tmp_path):
    (tmp_path / "a_file").write_text("x")
    for path, match in [(tmp_path, "it is a folder"), (tmp_path / "a_file" / "r.json", "its folder is not writable")]:
        model = TinyModel()
        with pytest.raises(ValueError, match=match):
            make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[NaNSkipReporter(report_path=path)]).fit(
                model
            )
        assert model.losses == []  # refused before the first step


def test_report_is_written_atomically_and_a_failed_write_never_hides_the_collapse(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=256.0)],
        callbacks=[NaNSkipReporter(report_path=path)],
        max_steps=4,
    ).fit(TinyModel(poison={1: "inf"}))
    assert json.loads(path.read_text())["skipped_steps"] == [1]
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # no temporary file left behind

    import lightning_amp_plus.callbacks.nan_skip_reporter as module

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_json_atomically", refuse)
    reporter = NaNSkipReporter(report_path=path, max_consecutive_skips=2, max_warnings=0)
    with pytest.raises(LossScaleCollapseError, match=r"2 consecutive .*could not be written .*No space left"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[reporter], max_steps=6).fit(
            TinyModel(poison={s: "nan" for s in range(6)})
        )
    assert json.loads(path.read_text())["skipped_steps"] == [1]  # the old report is intact, never half written
    ok = NaNSkipReporter(report_path=path, max_warnings=0)
    with pytest.warns(AmpPlusWarning, match="could not write the skip report"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[ok], max_steps=2).fit(TinyModel())


# ---------------------------------------------------------------------------------------------- 6: real error first
class GanFails(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.d, self.g = nn.Linear(8, 1), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.d(x).float(), y))
        opt_d.step()
        opt_d.zero_grad()
        if self.trainer.global_step >= 3:
            raise KeyError("the user's own bug")
        self.manual_backward(nn.functional.mse_loss(self.g(x).float(), y))
        opt_g.step()
        opt_g.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)

    def train_dataloader(self):
        return make_loader()


def test_an_error_mid_batch_in_manual_optimization_comes_through_alone():
    plugin = AmpPlusPrecision("16-mixed", init_scale=256.0)
    with pytest.raises(KeyError, match="the user's own bug") as info:
        make_trainer(plugins=[plugin], callbacks=[NaNSkipReporter()], max_steps=10).fit(GanFails())
    assert info.value.__context__ is None  # nothing raised while handling it
    assert plugin.history.num_steps == 2  # two whole batches, and the failed batch's one applied step
    assert not plugin.engine.cycle_open


# ---------------------------------------------------------------------------------------------- 8: the plot command
def test_plot_command_exits_2_with_one_line_on_bad_csv(tmp_path, capsys):
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("step,amp/loss_scale\n0,1024\n1,512,7\n")
    infinite = tmp_path / "inf.csv"
    infinite.write_text("step,amp/loss_scale\n0,1024\ninf,512\n")
    for path, match in [(ragged, "more fields than the header"), (infinite, "step 'inf' is not a step index")]:
        assert cli(["plot", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert err[0].startswith("error: ")
        assert match in err[0]


def test_plot_command_prints_the_path_it_wrote(tmp_path, capsys):
    data = tmp_path / "m.csv"
    data.write_text("step,amp/loss_scale,amp/skipped_steps\n0,1024,0\n3,512,1\n5,512,1\n")
    assert cli(["plot", str(data), "-o", str(tmp_path / "noext")]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(tmp_path / "noext.png")
    assert os.path.getsize(printed) > 1000


# ---------------------------------------------------------------------------------------------- 9: validation
@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("gpu", r"`AmpPlusPrecision\(device='gpu'\)` is invalid: expected a device type .* HINT: use 'cuda'"),
        ("CPU", r"device='CPU'\)` is invalid: .* HINT: device types are lower case: 'cpu'"),
        ("nosuch", r"device='nosuch'\)` is invalid: expected a device type that autocast supports"),
        ("cpu:0", r"device='cpu:0'\)` is invalid: expected a device type .*, not a device .* HINT: use device='cpu'"),
    ],
)
def test_device_is_checked_at_construction(device, match):
    with pytest.raises(ValueError, match=match):
        AmpPlusPrecision("16-mixed", device=device)
    with pytest.raises(ValueError, match=match.replace("AmpPlusPrecision", "AmpPlusFabricPrecision")):
        AmpPlusFabricPrecision("16-mixed", device=device)


def test_a_device_other_than_the_trainers_is_refused_not_silently_fp32():
    model = TinyModel()
    # a device type autocast supports here (torch 2.4 has no mps autocast), not the trainer's
    other = next(d for d in ("mps", "xpu", "hpu") if torch.amp.autocast_mode.is_autocast_available(d))
    with pytest.raises(ValueError, match=rf"device='{other}'\)` does not match the trainer's device \('cpu'\)"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", device=other)], max_steps=1).fit(model)
    assert model.losses == []


@pytest.mark.parametrize("make", [LossScaleMonitor, NaNSkipReporter, GradUnderflowMonitor])
@pytest.mark.parametrize("prefix", [None, 42])
def test_every_callback_refuses_a_prefix_that_is_not_a_str(make, prefix):
    got = type(prefix).__name__
    with pytest.raises(
        TypeError, match=rf"^`{make.__name__}\(prefix={prefix!r}\)` is invalid: expected a str .*, got {got}\.$"
    ):
        make(prefix=prefix)


@pytest.mark.parametrize(
    ("make", "kwargs", "name"),
    [
        (AmpPlusPrecision, {"init_scale": "1024"}, "init_scale"),
        (AmpPlusPrecision, {"growth_interval": "10"}, "growth_interval"),
        (NaNSkipReporter, {"max_warnings": "5"}, "max_warnings"),
        (LossScaleMonitor, {"logging_interval": "10"}, "logging_interval"),
        (GradUnderflowMonitor, {"warn_fraction": "0.5"}, "warn_fraction"),
        (PrecisionReport, {"flag_share": "0.5"}, "flag_share"),
    ],
)
def test_numeric_strings_are_a_type_error_everywhere(make, kwargs, name):
    with pytest.raises(TypeError, match=rf"`{make.__name__}\({name}='[0-9.]+'\)` is invalid: expected"):
        make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 1e-50, "min_scale": 0}, r"init_scale=1e-50\)` is invalid: expected a finite float32"),
        ({"growth_factor": 1e308}, r"growth_factor=1e\+308\)` is invalid"),
        ({"init_scale": 1e39, "max_scale": float("inf")}, r"init_scale=1e\+39\)` is invalid"),
        ({"hysteresis": 2**31}, r"hysteresis=2147483648\)` is invalid: .*int32"),
        ({"warn_skip_streak": 0}, r"warn_skip_streak=0\)` is invalid"),
    ],
)
def test_knobs_float32_cannot_hold_are_refused_by_the_plugins(kwargs, match):
    with pytest.raises(ValueError, match=r"`AmpPlusPrecision\(" + match):
        AmpPlusPrecision("16-mixed", **kwargs)
    with pytest.raises(ValueError, match=r"`AmpPlusFabricPrecision\(" + match):
        AmpPlusFabricPrecision("16-mixed", **kwargs)


# ---------------------------------------------------------------------------------------------- 10: silent failure
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_the_plugin_itself_says_when_every_step_is_skipped(optimizer, tmp_path):
    plugin = AmpPlusPrecision("16-mixed", warn_skip_streak=10)
    model = TinyModel(poison={s: "nan" for s in range(40)}, optimizer=optimizer, lr=1e-3)
    monitor = [LossScaleMonitor(logging_interval=5)] if optimizer == "fused_adamw" else []  # flushes: seen there
    with pytest.warns(AmpPlusWarning, match=r"optimizer updates in a row were skipped") as caught:
        make_trainer(plugins=[plugin], callbacks=monitor, max_steps=30, logger=CSVLogger(tmp_path)).fit(model)
    streak = [w for w in caught if "in a row were skipped" in str(w.message)]
    assert len(streak) == 1  # once per streak
    first = int(str(streak[0].message).split()[0])
    assert first == 10 if optimizer == "sgd" else 10 <= first <= 15


def test_skip_records_are_bounded_and_every_skip_still_counted(tmp_path):
    model = TinyModel(poison={s: "inf" for s in range(0, 40, 3)})
    plugin = AmpPlusPrecision("16-mixed", min_scale=2.0**-20)
    reporter = NaNSkipReporter(max_records=4, max_warnings=0, report_path=tmp_path / "r.json")
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=40).fit(model)
    steps = list(range(0, 40, 3))
    assert reporter.num_skips == len(steps) == 14
    assert reporter.skipped_steps == steps
    assert [r["step"] for r in reporter.skips] == [0, 3, 36, 39]  # the first and the last two in full
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_skipped"] == 14
    assert report["records_dropped"] == 10
    assert report["worst_offenders"][0]["skips"] == 14  # counted over every skip
    state = reporter.state_dict()
    restored = NaNSkipReporter(max_records=4)
    restored.load_state_dict(state)
    assert restored.skips == reporter.skips
    assert restored.report()["worst_offenders"] == reporter.report()["worst_offenders"]


def test_fractions_are_refused_outside_zero_exclusive_to_one_inclusive():
    from lightning_amp_plus import GradUnderflowMonitor, PrecisionReport

    assert GradUnderflowMonitor(warn_fraction=1).warn_fraction == 1.0
    assert PrecisionReport(flag_share=1e-9).flag_share == 1e-9
    for bad in (0.0, 1.0000001, 1.5, -0.5):
        with pytest.raises(
            ValueError, match=rf"^`GradUnderflowMonitor\(warn_fraction={bad!r}\)` is invalid: expected 0 <"
        ):
            GradUnderflowMonitor(warn_fraction=bad)
    with pytest.raises(
        TypeError, match=r"^`PrecisionReport\(flag_share='x'\)` is invalid: expected a real number, got str"
    ):
        PrecisionReport(flag_share="x")


@pytest.mark.parametrize(
    ("device", "hint"),
    [
        ("auto", " HINT: leave `device=None` to follow the trainer's accelerator."),
        ("CPU", " HINT: device types are lower case: 'cpu'."),
        ("gpu", " HINT: use 'cuda'."),
        ("nope", ""),
    ],
)
def test_a_device_autocast_does_not_know_is_refused_with_its_hint(device, hint):
    expected = (
        f"`AmpPlusPrecision(device='{device}')` is invalid: expected a device type that autocast supports, such as"
        " 'cuda', 'cpu', 'mps', 'xpu' or 'hpu', or None for the trainer's accelerator." + hint
    )
    with pytest.raises(ValueError, match="is invalid") as err:
        AmpPlusPrecision(device=device)
    assert str(err.value) == expected


@pytest.mark.parametrize("state", [[1, 2], "scaler", None])
def test_a_state_that_is_not_a_dict_is_refused_naming_where_and_what_it_got(state):
    from lightning_amp_plus.engine import AmpEngine

    engine = AmpPlusPrecision("16-mixed").engine
    kind = type(state).__name__
    with pytest.raises(TypeError, match=rf"^`AmpEngine\.load_state_dict` is invalid: expected a dict .*, got {kind}: "):
        engine.load_state_dict(state)
    with pytest.raises(TypeError, match=rf"^`checkpoint\['AmpPlusPrecision'\]` is invalid: .* got {kind}: "):
        AmpPlusPrecision("16-mixed").load_state_dict(state)
    assert isinstance(engine, AmpEngine)


@pytest.mark.parametrize("value", [1.5, "3", True])
def test_an_int_argument_of_another_type_names_the_type_it_got(value):
    from lightning_amp_plus import LossScaleMonitor

    got = type(value).__name__
    with pytest.raises(
        TypeError, match=rf"^`LossScaleMonitor\(logging_interval={value!r}\)` is invalid: expected an int, got {got}\.$"
    ):
        LossScaleMonitor(logging_interval=value)


# --------------------------------------------------------------------------- the scaler's knobs, each message whole
_TINY, _MAX = 2.0**-126, 3.4028234663852886e38
_SPAN = "[1.1754943508222875e-38, 3.4028234663852886e+38]"
_SCALE = f"expected a finite float32 scale in {_SPAN} (2**-126 to float32's max), whose inverse float32 can hold too."
_GROWTH = (
    "expected a finite number > 1 that float32 can hold (the scale is multiplied by it after `growth_interval`"
    " clean steps)."
)
_BACKOFF = (
    "expected 0 < backoff_factor < 1, at least 2**-126 so that float32 can hold it (the scale is multiplied by it"
    " when a step overflows)."
)
_INT = "expected an int in [1, 2147483647] (the device tracker is int32)."
_MIN = f"expected 0 (no bound but float32's) or a finite float32 scale in {_SPAN}."
_MAXS = f"expected inf or a finite float32 scale in {_SPAN}."


@pytest.mark.parametrize(
    ("name", "value", "error", "expected"),
    [
        ("init_scale", "x", TypeError, "expected a real number, got str."),
        ("init_scale", math.inf, ValueError, _SCALE),
        ("init_scale", 0.0, ValueError, _SCALE),
        ("init_scale", _TINY / 2, ValueError, _SCALE),
        ("init_scale", _MAX * 2, ValueError, _SCALE),
        ("growth_factor", "x", TypeError, "expected a real number, got str."),
        ("growth_factor", 1.0, ValueError, _GROWTH),
        ("growth_factor", math.inf, ValueError, _GROWTH),
        ("growth_factor", _MAX * 2, ValueError, _GROWTH),
        (
            "growth_factor",
            1 + 2**-30,
            ValueError,
            "float32 rounds it to 1.0, so the scale would never grow; expected a factor float32 tells from 1"
            " (> 1 + 2**-24, e.g. 1.001).",
        ),
        ("backoff_factor", "x", TypeError, "expected a real number, got str."),
        ("backoff_factor", 1.0, ValueError, _BACKOFF),
        ("backoff_factor", _TINY / 2, ValueError, _BACKOFF),
        (
            "backoff_factor",
            1 - 2**-30,
            ValueError,
            "float32 rounds it to 1.0, so the scale would never back off; expected a factor float32 tells from 1"
            " (< 1 - 2**-25, e.g. 0.999).",
        ),
        ("growth_interval", 1.5, TypeError, "expected an int, got float."),
        ("growth_interval", True, TypeError, "expected an int, got bool."),
        ("growth_interval", 0, ValueError, _INT),
        ("growth_interval", 2**31, ValueError, _INT),
        ("hysteresis", 0, ValueError, _INT),
        ("hysteresis", "x", TypeError, "expected an int, got str."),
        ("min_scale", "x", TypeError, "expected a real number, got str."),
        ("min_scale", -1.0, ValueError, _MIN),
        ("min_scale", math.inf, ValueError, _MIN),
        ("min_scale", _TINY / 2, ValueError, _MIN),
        ("max_scale", "x", TypeError, "expected a real number, got str."),
        ("max_scale", 0.0, ValueError, _MAXS),
        ("max_scale", _MAX * 2, ValueError, _MAXS),
        ("max_scale", _TINY / 2, ValueError, _MAXS),
    ],
)
def test_each_scaler_knob_is_refused_with_its_whole_message(name, value, error, expected):
    with pytest.raises(error) as caught:
        AmpPlusPrecision("16-mixed", **{name: value})
    assert str(caught.value) == f"`AmpPlusPrecision({name}={value!r})` is invalid: {expected}"


def test_the_scale_bounds_are_refused_together_with_their_whole_message():
    with pytest.raises(ValueError, match="is invalid") as caught:
        AmpPlusPrecision("16-mixed", min_scale=4.0, max_scale=2.0)
    assert str(caught.value) == (
        "`AmpPlusPrecision(min_scale=4.0, max_scale=2.0)` is invalid: expected min_scale <= max_scale."
    )
    with pytest.raises(ValueError, match="is invalid") as caught:
        AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=2.0, max_scale=4.0)
    assert str(caught.value) == (
        "`AmpPlusPrecision(init_scale=1.0, min_scale=2.0, max_scale=4.0)` is invalid: expected min_scale <= init_scale"
        " <= max_scale. HINT: widen `min_scale`/`max_scale` or change `init_scale`."
    )


@pytest.mark.parametrize(
    "knobs",
    [
        {"init_scale": _TINY, "min_scale": 0.0},
        {"init_scale": _MAX, "max_scale": math.inf},
        {"init_scale": 4.0, "min_scale": 4.0, "max_scale": 4.0},
        {"growth_factor": _MAX},
        {"growth_factor": 1 + 2**-20},
        {"backoff_factor": _TINY},
        {"backoff_factor": 1 - 2**-20},
        {"growth_interval": 1, "hysteresis": 1},
        {"growth_interval": 2**31 - 1, "hysteresis": 2**31 - 1},
        {"min_scale": _TINY},
        {"max_scale": _MAX},
    ],
)
def test_every_boundary_value_is_taken(knobs):
    knobs_in_force = AmpPlusPrecision("16-mixed", **knobs).scaler.knobs()
    assert {k: knobs_in_force[k] for k in knobs} == knobs


def test_a_knob_given_as_none_is_its_default_as_in_0_2():
    """0.2's signatures defaulted every knob to None: its saved LightningCLI configs hold `growth_factor: null`."""
    for make in (AmpPlusPrecision, AmpPlusFabricPrecision):
        plugin = make("16-mixed", **{**dict.fromkeys(DEFAULTS), "growth_interval": 20})
        assert plugin.scaler.knobs() == {**DEFAULTS, "growth_interval": 20}
        assert repr(plugin) == f"{make.__name__}(growth_interval=20)"  # None is no argument given
    assert DynamicLossScaler("cpu", init_scale=None, max_scale=None).knobs() == DEFAULTS


def test_numpy_scalars_are_numbers_and_kept_as_python_ones():
    np = pytest.importorskip("numpy")
    plugin = AmpPlusPrecision("16-mixed", init_scale=np.float32(1024.0), growth_interval=np.int64(100))
    knobs = plugin.scaler.knobs()
    assert (knobs["init_scale"], knobs["growth_interval"]) == (1024.0, 100)
    assert (type(knobs["init_scale"]), type(knobs["growth_interval"])) == (float, int)
    assert repr(plugin) == "AmpPlusPrecision(init_scale=1024.0, growth_interval=100)"  # a call that pastes
    with pytest.raises(TypeError, match=r"growth_interval=(np.float64\(1.5\)|1.5)\)` is invalid: expected an int"):
        AmpPlusPrecision("16-mixed", growth_interval=np.float64(1.5))


def test_a_numpy_bool_is_named_as_what_it_is():
    np = pytest.importorskip("numpy")
    with pytest.raises(
        TypeError, match=r"skip_nonfinite=(np.True_|True)\)` is invalid: expected a bool, got numpy.bool_?\.$"
    ):
        AmpPlusPrecision("16-mixed", skip_nonfinite=np.True_)  # not "expected a bool, got bool"


def test_an_int_beyond_floats_range_is_told_not_an_overflow_error():
    with pytest.raises(ValueError, match=r"`AmpPlusPrecision\(init_scale=inf\)` is invalid: expected a finite"):
        AmpPlusPrecision("16-mixed", init_scale=10**400)
    assert AmpPlusPrecision("16-mixed", max_scale=2**1024).scaler.max_scale == math.inf  # beyond any bound: none


@pytest.mark.parametrize("new_scale", [math.nan, math.inf, 0.0, -1.0, "2", torch.ones(2), torch.ones(0)])
def test_update_refuses_a_new_scale_that_is_no_scale(new_scale):
    """A number must be finite and > 0; a tensor must hold one element (its value is not read: no sync)."""
    scaler = DynamicLossScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(1, requires_grad=True))
    told = rf"`DynamicLossScaler.update\(new_scale={re.escape(repr(new_scale))}\)` is invalid: .* one-element tensor"
    with pytest.raises(ValueError, match=told):
        scaler.update(new_scale)
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize(
    "new_scale",
    [2048, 2048.0, "np.float64", "np.float32", torch.tensor(2048.0), torch.tensor([2048.0], requires_grad=True)],
)
def test_update_takes_a_new_scale_as_a_number_or_a_one_element_tensor(new_scale):
    """An int is a number (torch's update took it for a tensor: AttributeError); a numpy scalar too (numpy 2's have a
    ``device`` and no ``numel``: break pass); a tensor's value is copied."""
    if isinstance(new_scale, str):
        np = pytest.importorskip("numpy")
        new_scale = getattr(np, new_scale.split(".")[1])(2048.0)
    scaler = DynamicLossScaler("cpu", init_scale=4.0, max_scale=2.0**20)
    scaler.scale(torch.ones(1, requires_grad=True))
    scaler.update(new_scale)
    assert scaler.get_scale() == 2048.0
    assert scaler.last_update().skipped is False  # a scale set between cycles: recorded, not a skip


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        ("NaNSkipReporter", "quiet"),
        ("GradUnderflowMonitor", "quiet"),
        ("GradUnderflowMonitor", "exact"),
    ],
)
def test_the_new_switches_take_a_bool_only(cls, name):
    import lightning_amp_plus

    with pytest.raises(TypeError, match=rf"^`{cls}\({name}=1\)` is invalid: expected a bool, got int\.$"):
        getattr(lightning_amp_plus, cls)(**{name: 1})


def test_the_streak_warning_shows_the_scale_in_full():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**30, max_scale=2.0**30, warn_skip_streak=10)
    model = TinyModel(poison={s: "nan" for s in range(12)})
    with pytest.warns(AmpPlusWarning, match=r"in a row were skipped") as caught:
        make_trainer(plugins=[plugin], max_steps=12).fit(model)
    (streak,) = [str(w.message) for w in caught if "in a row were skipped" in str(w.message)]
    assert "loss scale 1048576:" in streak  # 2**30 halved ten times, exactly (not 1.04858e+06)
