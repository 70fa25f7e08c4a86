"""AmpAdvisor: each code on a run that really has the problem, the fix applied, and no false alarm on a healthy run."""

import json

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import (
    Advice,
    AmpAdvisor,
    AmpPlusPrecision,
    AmpPlusWarning,
    GradUnderflowMonitor,
    LossScaleCollapseError,
    LossScaleMonitor,
    NaNSkipReporter,
)
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer


def fit(model, plugin=None, callbacks=(), max_steps=12, **kwargs):
    advisor = AmpAdvisor()
    plugin = plugin or AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(plugins=[plugin], callbacks=[advisor, *callbacks], max_steps=max_steps, **kwargs).fit(model)
    return advisor, plugin


def applied(fix):
    """The plugin a printed fix line builds, pasted as printed."""
    return eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})


def named(non_fused):
    """The optimizers that could fuse: name and device (no fused call, no timings)."""
    return [{k: o[k] for k in ("name", "device")} for o in non_fused]


@pytest.fixture
def fused_saves(monkeypatch):
    """The timings of a device where the fused step saves ``fused_saves(ms)`` of a 10 ms step (not wall clock).

    ``noise``: every third pair's gain lowered by that much (the spread a quiet machine does not have).
    """
    from lightning_amp_plus.callbacks import _fused
    from lightning_amp_plus.callbacks.advisor import AmpAdvisor as Advisor

    def setup(saved_ms, noise=0.0):
        pairs = [(1.0 + saved_ms - (noise if i % 3 == 0 else 0.0), 1.0) for i in range(_fused.TIMED_STEPS)]
        monkeypatch.setattr(_fused, "step_times", lambda optimizer: _fused.summary(pairs))
        monkeypatch.setattr(Advisor, "_step_ms", lambda self: 10.0)

    return setup


def codes(advisor):
    """The findings' codes, then the speed hints' (as the advisor prints them)."""
    return [a.code for a in advisor.advice + advisor.hints]


def only(advisor, code):
    (advice,) = [a for a in advisor.advice + advisor.hints if a.code == code]
    return advice


class Overflowing(TinyModel):
    """``big`` multiplies by about 1e6: float16 overflows in its forward, float32 does not; a LayerNorm follows."""

    def __init__(self, **kwargs):
        super().__init__(optimizer="fused_sgd", **kwargs)
        self.big = nn.Linear(8, 8)
        with torch.no_grad():
            self.big.weight.mul_(1e6)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.net(self.norm(self.big(x)))


def test_fp32_module_names_the_module_where_inf_is_born_and_the_island_fixes_it():
    advisor, plugin = fit(Overflowing(), max_steps=6)
    assert codes(advisor)[0] == "fp32_module"  # most important first
    advice = only(advisor, "fp32_module")
    assert advice.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, fp32_modules=["big"])'  # theirs + 1
    assert advice.evidence["module"] == "big"
    assert (
        advice.evidence["skips"] == plugin.history.num_skipped - 1
    )  # the first one, read from the loss, starts the watch
    assert advice.evidence["measured"] is False
    assert "nonfinite_loss" not in codes(advisor)
    fixed, fixed_plugin = fit(Overflowing(), applied(advice.fix), max_steps=6)
    assert fixed_plugin.history.num_skipped < plugin.history.num_skipped
    assert "fp32_module" not in codes(fixed)


def poisoned_loader(rows):
    loader = make_loader(n=48, batch_size=4)
    x, y = loader.dataset.tensors
    x = x.clone()
    for row in rows:
        x[row, 0] = float("inf")
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


class Data(TinyModel):
    def __init__(self, rows=(), **kwargs):
        super().__init__(optimizer="fused_sgd", **kwargs)
        self.rows = rows

    def train_dataloader(self):
        return poisoned_loader(self.rows)


def test_nonfinite_loss_for_inf_in_the_batch_never_an_island():
    advisor, plugin = fit(Data(rows=(5, 13, 22)))  # batches 1, 3, 5
    assert plugin.history.skipped_steps == [1, 3, 5]
    assert codes(advisor)[0] == "nonfinite_loss"
    advice = only(advisor, "nonfinite_loss")
    assert advice.evidence == {"input": 3, "loss": 0, "told": 3}
    assert "torch.isfinite" in advice.fix
    assert "fp32_module" not in codes(advisor)
    fixed, fixed_plugin = fit(Data(rows=()))  # what the fix says: clean data
    assert fixed_plugin.history.num_skipped == 0
    assert codes(fixed) == []


def test_skips_born_in_the_batch_at_the_scale_floor_say_the_batch_not_bf16(tmp_path):
    """A skip's origin is matched to its step: overflows born in the batch say nothing about float16's range."""
    advisor = AmpAdvisor(report_path=tmp_path / "advice.json", print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)  # every skip at the floor
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=12).fit(Data(rows=(5, 13, 22)))
    assert plugin.history.skipped_steps == [1, 3, 5]
    assert codes(advisor) == ["nonfinite_loss"]
    report = json.loads((tmp_path / "advice.json").read_text())
    assert report == {"healthy": False, "summary": None, "advice": [a.to_dict() for a in advisor.advice], "speed": []}


def test_nonfinite_loss_for_a_loss_that_is_inf_with_finite_outputs():
    advisor, _ = fit(TinyModel(optimizer="fused_sgd", poison={2: "inf", 4: "nan", 6: "inf"}))
    advice = only(advisor, "nonfinite_loss")
    assert advice.evidence == {"input": 0, "loss": 2, "told": 2}  # the first one, read from the loss, starts the watch
    assert "float()" in advice.fix


class Slow(TinyModel):
    """A heavy head run with autocast disabled in user code (``fp32=True``) or under autocast."""

    def __init__(self, fp32):
        super().__init__(optimizer="fused_sgd")
        self.fp32 = fp32
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        h = self.net(x)
        if not self.fp32:
            return self.head(h)
        with torch.autocast(self.device.type, enabled=False):
            return self.head(h.float())


@pytest.fixture
def lowered_runs_faster(monkeypatch):
    """A device where autocast's lower precision runs 3x faster (a GPU's tensor cores): timings are injected."""
    from lightning_amp_plus.callbacks import precision_report

    measured = []

    def faster(module, *args, **kwargs):
        measured.append(module)
        return 3.0

    monkeypatch.setattr(precision_report, "lowered_speedup", faster)
    return measured


def test_silent_fp32_names_the_module_and_the_cause(lowered_runs_faster):
    advisor, _ = fit(Slow(fp32=True), max_steps=3)
    advice = only(advisor, "silent_fp32")
    assert "head (" in advice.message
    assert "3.0x faster lowered here" in advice.message
    assert "autocast disabled" in advice.message
    assert "enabled=False" in advice.fix
    assert [m["name"] for m in advice.evidence["modules"]] == ["head"]
    fixed, _ = fit(Slow(fp32=False), max_steps=3)
    assert "silent_fp32" not in codes(fixed)


class Norms(TinyModel):
    """Most of the forward in a LayerNorm and a GELU, which autocast keeps in (or passes through as) float32."""

    def __init__(self):
        super().__init__(optimizer="fused_sgd", features=512)
        self.norm, self.act = nn.LayerNorm(512), nn.GELU()

    def forward(self, x):
        return self.net(self.act(self.norm(x.repeat(1, 1) * 2)))

    def train_dataloader(self):
        return make_loader(features=512, batch_size=64)


def test_no_silent_fp32_for_work_autocast_would_not_lower(lowered_runs_faster):
    advisor, _ = fit(Norms(), max_steps=3)
    assert "silent_fp32" not in codes(advisor)  # nothing to lower: a norm and an activation
    assert all(type(m).__name__ not in ("LayerNorm", "GELU") for m in lowered_runs_faster)


class BigHead(Slow):
    def __init__(self):
        super().__init__(fp32=True)
        self.net = nn.Sequential(nn.Linear(8, 512), nn.ReLU())
        self.head = nn.Linear(512, 512)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).float().pow(2).mean()


def test_silent_fp32_follows_the_measured_speed_on_this_device():
    # float16 on a CPU: a float32 head is not slower, so the advice stays silent (its figure says why)
    advisor, _ = fit(BigHead(), max_steps=2)
    (row,) = [r for r in advisor._report.rows if r["name"] == "head"]
    assert row["flagged"]
    assert row["lowered_speedup"] is not None  # measured, not assumed
    assert ("silent_fp32" in codes(advisor)) is (row["lowered_speedup"] >= 1.2)


def test_init_scale_gives_the_scale_the_run_settled_at():
    advisor, plugin = fit(
        TinyModel(optimizer="fused_sgd", lr=0.01),
        AmpPlusPrecision("16-mixed", init_scale=2.0**40, max_scale=2.0**40),
        max_steps=30,
    )
    advice = only(advisor, "init_scale")
    leading = advice.evidence["leading_skips"]
    assert plugin.history.skipped_steps[:leading] == list(range(leading))
    settled = plugin.history.scale_at(leading)
    assert advice.evidence["settled_scale"] == settled
    exponent = int(torch.tensor(settled).log2())
    assert advice.fix == f'AmpPlusPrecision("16-mixed", init_scale=2.0**{exponent}, max_scale=2.0**40)'
    fixed, fixed_plugin = fit(TinyModel(optimizer="fused_sgd", lr=0.01), applied(advice.fix), max_steps=30)
    assert fixed_plugin.history.num_skipped < plugin.history.num_skipped
    assert "init_scale" not in codes(fixed)


def test_growth_interval_after_a_backoff_that_never_grows_back():
    # tiny gradients (float16 subnormals at this scale): the halved scale costs bits, and it never grows back
    model = Tiny(optimizer="fused_sgd", grad_poison={10: "net.0.weight"})
    advisor, plugin = fit(model, AmpPlusPrecision("16-mixed", init_scale=1024.0), max_steps=80, log_every_n_steps=20)
    advice = only(advisor, "growth_interval")
    assert advice.evidence["backoff_step"] == 11  # the halved scale is first used by the next update
    assert advice.evidence["clean_updates_after"] == 69
    assert advice.evidence["underflow_after"] > 0.05
    assert advice.fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=10)'
    model = Tiny(optimizer="fused_sgd", grad_poison={10: "net.0.weight"})
    fixed, fixed_plugin = fit(model, applied(advice.fix), max_steps=80, log_every_n_steps=20)
    assert fixed_plugin.history.scale_at(79) > plugin.history.scale_at(79)  # it grew back
    assert "growth_interval" not in codes(fixed)


class SmallGrads(TinyModel):
    """True gradients around 1e-7: normal in float16 at scale 1024, partly subnormal at 512."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-6


def _mean_underflow(advisor):
    fractions = [m["underflow_fraction"] for m in advisor.figures.underflow if m["underflow_fraction"] is not None]
    return sum(fractions) / len(fractions)


def test_hysteresis_for_rare_spikes_at_the_cap_whose_halving_costs_bits():
    poison = {10: "net.0.weight", 30: "net.0.weight", 50: "net.0.weight"}
    knobs = dict(init_scale=1024.0, growth_interval=5, max_scale=1024.0)
    kwargs = dict(max_steps=60, log_every_n_steps=1)
    torch.manual_seed(0)  # both runs from the same weights
    advisor, plugin = fit(
        SmallGrads(optimizer="fused_sgd", grad_poison=poison), AmpPlusPrecision("16-mixed", **knobs), **kwargs
    )
    advice = only(advisor, "hysteresis")
    assert advice.evidence["isolated_overflows"] == [10, 30, 50]
    assert advice.evidence["regrowth_updates"] == [5, 5, 5]  # not the gaps between the spikes
    assert advice.fix.startswith(
        'AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=5, max_scale=2.0**10, hysteresis=2)  #'
    )
    torch.manual_seed(0)
    fixed, fixed_plugin = fit(SmallGrads(optimizer="fused_sgd", grad_poison=poison), applied(advice.fix), **kwargs)
    assert [s for s, _ in fixed_plugin.history.curve()] == [0]  # no halving at all: the scale stayed at 1024
    assert fixed_plugin.history.num_skipped == plugin.history.num_skipped  # no more skips
    assert _mean_underflow(fixed) < _mean_underflow(advisor)  # and fewer gradient bits lost: measured to help
    assert "hysteresis" not in codes(fixed)


class Ceiling(TinyModel):
    """Gradients that overflow float16 from a scale of about 2**13: the scale grows into it again and again."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 4.0


def test_no_hysteresis_on_the_saw_tooth_where_it_would_add_skips():
    knobs = dict(init_scale=2.0**10, growth_interval=5)
    advisor, plugin = fit(Ceiling(optimizer="fused_sgd", lr=1e-3), AmpPlusPrecision("16-mixed", **knobs), max_steps=80)
    assert plugin.history.num_skipped >= 3  # the saw-tooth: each growth into the ceiling overflows once
    assert "hysteresis" not in codes(advisor)
    _, held = fit(
        Ceiling(optimizer="fused_sgd", lr=1e-3), AmpPlusPrecision("16-mixed", hysteresis=2, **knobs), max_steps=80
    )
    assert held.history.num_skipped > plugin.history.num_skipped  # what the old advice did: more skips, measured


class Tiny(TinyModel):
    """True gradients around 1e-7."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-6


def test_max_scale_when_the_cap_holds_the_scale_down_with_headroom_left():
    """Without a float32 reference: the scale started and capped where the headroom allows, helping from the start."""
    plugin = AmpPlusPrecision("16-mixed", init_scale=16.0, max_scale=16.0, growth_interval=2)
    advisor, _ = fit(Tiny(optimizer="fused_sgd"), plugin, max_steps=8, log_every_n_steps=2)
    advice = only(advisor, "max_scale")
    assert advice.evidence["max_scale"] == 16.0
    assert advice.evidence["headroom_bits"] > 20
    new = 16.0 * 2.0 ** int(advice.evidence["headroom_bits"] - 1)
    e = int(torch.tensor(new).log2())
    assert advice.fix == f'AmpPlusPrecision("16-mixed", init_scale=2.0**{e}, growth_interval=2, max_scale=2.0**{e})'
    before = [m["underflow_fraction"] for m in advisor.figures.underflow]
    fixed, fixed_plugin = fit(Tiny(optimizer="fused_sgd"), applied(advice.fix), max_steps=8, log_every_n_steps=2)
    after = [m["underflow_fraction"] for m in fixed.figures.underflow]
    assert fixed_plugin.scaler.get_scale() > 2.0**12  # in the room the cap now leaves, within the same 8 steps
    assert max(after) < min(before) / 2  # and keeps what the cap made float16 lose, from the first measurement
    assert fixed_plugin.history.num_skipped == 0
    assert "bf16" not in codes(fixed)


def test_max_scale_from_the_float32_reference_fits_the_backward():
    import math

    plugin = AmpPlusPrecision("16-mixed", init_scale=16.0, max_scale=16.0)
    monitor = [GradUnderflowMonitor(exact=True)]  # the float32 reference only where asked for by name
    advisor, _ = fit(Tiny(optimizer="fused_sgd"), plugin, callbacks=monitor, max_steps=8, log_every_n_steps=2)
    advice = only(advisor, "max_scale")
    top = max(m["true_log2_max"] for m in advisor.figures.underflow)  # the backward's largest gradient, in float32
    new = 2.0 ** (math.floor(math.log2(65504.0) - top) - 1)
    assert advice.evidence["fitting_scale"] == new
    exponent = int(torch.tensor(new).log2())
    assert advice.fix == f'AmpPlusPrecision("16-mixed", init_scale=2.0**{exponent}, max_scale=2.0**{exponent})'
    fixed, fixed_plugin = fit(
        Tiny(optimizer="fused_sgd"), applied(advice.fix), callbacks=[GradUnderflowMonitor(exact=True)], max_steps=8
    )
    assert fixed_plugin.history.num_skipped == 0  # the fitting scale overflows nothing in backward
    assert "max_scale" not in codes(fixed)
    assert "bf16" not in codes(fixed)


class Huge(TinyModel):
    """Gradients beyond float16's range even unscaled: the loss is multiplied by 1e7 (finite in float32)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e7


def test_overflows_in_backward_at_min_scale_are_not_called_float16s_range_without_evidence():
    """Every update overflows in backward at the floor: range (bf16 fixes it) or the model's own NaN (nothing does).
    Without a rerun nothing measured tells which: the advice says so, and its fix is the rerun that does
    (`tests/test_backward_origins.py` follows it to `bf16`, applied and measured)."""
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    advisor, _ = fit(Huge(optimizer="fused_sgd", lr=1e-12), plugin, max_steps=6)
    assert codes(advisor) == ["backward_skips"]
    advice = only(advisor, "backward_skips")
    assert advice.evidence["skipped_at_min_scale"] == plugin.history.num_skipped == 6
    assert advice.fix.startswith("NaNSkipReporter(backward_origin=True)")


def test_fused_optimizer_for_a_non_fused_adamw(fused_saves):
    fused_saves(0.5)  # 5% of the step
    advisor, _ = fit(TinyModel(optimizer="adamw"), max_steps=3)
    advice = only(advisor, "fused_optimizer")
    assert named(advice.evidence["optimizers"]) == [{"name": "AdamW", "device": "cpu"}]
    assert advice.fix == "torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)"  # the user's own call
    assert advice.message == (  # the trade-off is told
        "AdamW over self.parameters(): fused, its step takes 1.00 ms, not 1.50 ms (timed here), at least 5% of the"
        " 10.0 ms step. Skips are then told once the flag is read."
    )
    fixed, _ = fit(TinyModel(optimizer="fused_adamw"), max_steps=3)
    assert codes(fixed) == []


def test_no_fused_optimizer_advice_where_fusing_saves_nothing_measurable(fused_saves):
    fused_saves(0.19)  # 1.9% of the step: no measurable help
    advisor, _ = fit(TinyModel(optimizer="adamw"), max_steps=3)
    assert "fused_optimizer" not in codes(advisor)
    assert advisor.figures.non_fused[0]["step_ms"] == 1.19  # measured, and told nothing


def test_no_fused_optimizer_advice_on_one_delta_within_the_timings_noise(fused_saves):
    fused_saves(0.3, noise=0.5)  # a median 3% gain, yet the fused step was slower in three pairs of nine
    advisor, _ = fit(TinyModel(optimizer="adamw"), max_steps=3)
    assert "fused_optimizer" not in codes(advisor)
    timing = advisor.figures.non_fused[0]
    assert timing["gain_ms"] > 0.2
    assert timing["gain_low_ms"] < 0
    assert timing["pairs"] == 9


def test_the_fused_step_is_timed_on_copies_of_the_run():
    from lightning_amp_plus.callbacks._fused import step_times

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state.items()}
    grads = [p.grad.clone() for p in model.parameters()]
    times = step_times(optimizer)
    assert times is not None
    assert times["step_ms"] > 0
    assert times["fused_step_ms"] > 0
    assert times["pairs"] == 9
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the run's weights untouched
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    for key, value in optimizer.state.items():
        assert all(torch.equal(t, state[key][n]) for n, t in value.items())


def test_a_healthy_run_gets_no_advice_and_says_so(tmp_path, caplog):
    caplog.set_level("WARNING", logger="lightning_amp_plus")
    logger = CSVLogger(tmp_path, name="run")
    advisor = AmpAdvisor(report_path=tmp_path / "advice.json")
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=100)
    make_trainer(plugins=[plugin], callbacks=[advisor], logger=logger, max_steps=20, log_every_n_steps=5).fit(
        TinyModel(optimizer="fused_sgd")
    )
    assert advisor.advice == []
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor")]
    headroom = advisor.figures.underflow[-1]["headroom_bits"]  # the inner monitor's last measurement
    assert line == (
        "AmpAdvisor: the run looks healthy: 20 updates, skip rate 0.0% (0 skipped),"
        f" headroom {headroom:.1f} bits, loss scale 2.0**10."
    )
    report = json.loads((tmp_path / "advice.json").read_text())
    assert report == {"healthy": True, "summary": line[len("AmpAdvisor: ") :], "advice": [], "speed": []}
    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in f.read().splitlines() if r]
    header = rows[0].split(",")
    values = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:]]
    assert [(v["step"], v["amp/advice"]) for v in values if v.get("amp/advice")] == [("19", "0.0")]


def test_advice_on_collapse_reads_the_users_reporter(tmp_path):
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    advisor = AmpAdvisor(report_path=tmp_path / "advice.md")
    with pytest.raises(LossScaleCollapseError):
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter, advisor], max_steps=10
        ).fit(Overflowing())
    assert codes(advisor)[0] == "fp32_module"
    assert advisor._reporter is reporter  # its figures, not a second measurement
    assert advisor._own == [advisor._underflow, advisor._report]
    text = (tmp_path / "advice.md").read_text()
    assert text.startswith("# AmpAdvisor\n")
    assert "## `fp32_module`" in text
    assert 'fp32_modules=["big"]' in text


@pytest.mark.parametrize("advisor_first", [False, True])
def test_the_collapse_hint_reads_the_figures_the_advisor_reads_and_another_trainer_does_not(monkeypatch, advisor_first):
    from lightning_amp_plus.callbacks import nan_skip_reporter

    read = []
    real = nan_skip_reporter.collapse_advice
    monkeypatch.setattr(nan_skip_reporter, "collapse_advice", lambda f: read.append(f) or real(f))
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    advisor = AmpAdvisor()
    callbacks = [advisor, reporter] if advisor_first else [reporter, advisor]
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    with pytest.raises(LossScaleCollapseError):
        make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=10).fit(Overflowing())
    (figures,) = read
    assert figures.underflow  # the advisor's own GradUnderflowMonitor measured: the HINT weighs it as the advice does
    assert figures.underflow == advisor.figures.underflow
    assert figures.origins == advisor.figures.origins
    assert figures.non_fused is None  # the timed steps only the speed hints read are left out

    read.clear()  # the same reporter in a new Trainer without the advisor: its own figures, nothing of the old fit
    with pytest.raises(LossScaleCollapseError):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=10).fit(
            Overflowing()
        )
    (figures,) = read
    assert figures.underflow is None


def test_advice_objects_are_plain_data():
    advice = Advice("init_scale", "msg", 'AmpPlusPrecision("16-mixed", init_scale=2.0**10)', {"leading_skips": 3})
    assert advice.to_dict() == {
        "code": "init_scale",
        "message": "msg",
        "fix": 'AmpPlusPrecision("16-mixed", init_scale=2.0**10)',
        "evidence": {"leading_skips": 3},
    }
    assert str(advice).startswith("[init_scale] msg\n    fix: ")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"report_path": "advice.txt"}, r"^`AmpAdvisor\(report_path='advice.txt'\)` is invalid: .*\.md.*\.json"),
        ({"report_path": 3}, r"^`AmpAdvisor\(report_path=3\)` is invalid: expected a file path .*, got int\.$"),
        ({"print_advice": "yes"}, r"^`AmpAdvisor\(print_advice='yes'\)` is invalid: expected a bool, got str\.$"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AmpAdvisor(**kwargs)


def test_advice_is_given_once_when_the_fit_fails_after_training(fused_saves, caplog):
    fused_saves(1.0)
    """A callback failing in ``on_fit_end`` runs ``on_exception`` after ``on_train_end`` gave the advice."""
    from lightning.pytorch.callbacks import Callback

    class FailsAtTheEnd(Callback):
        def on_fit_end(self, trainer, pl_module):
            raise RuntimeError("after training")

    caplog.set_level("WARNING", logger="lightning_amp_plus")
    advisor = AmpAdvisor()
    assert (advisor.advice, advisor.figures) == ([], None)  # nothing before a fit
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor, FailsAtTheEnd()], max_steps=3)
    with pytest.raises(RuntimeError, match="after training"):
        trainer.fit(TinyModel(optimizer="adamw"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor")]
    assert len(lines) == 2  # the advice once; then how the fit ended, which takes back "healthy" (issue 54)
    assert "did not end as planned: RuntimeError: after training" in lines[1]
    assert codes(advisor) == ["fused_optimizer"]


def test_the_advisor_needs_our_plugin():
    with pytest.raises(ValueError, match="`AmpAdvisor` needs the `AmpPlusPrecision` plugin"):
        make_trainer(precision="bf16-mixed", callbacks=[AmpAdvisor()], max_steps=1).fit(TinyModel())


def test_a_second_trainer_starts_afresh_and_the_monitor_is_not_disturbed(tmp_path):
    advisor = AmpAdvisor(print_advice=False)
    monitor = LossScaleMonitor(logging_interval=2)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[advisor, monitor],
        logger=CSVLogger(tmp_path),
        max_steps=6,
    ).fit(TinyModel(optimizer="fused_sgd", poison={2: "inf", 4: "inf"}))
    assert codes(advisor) == ["nonfinite_loss"]
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], max_steps=4).fit(
        TinyModel(optimizer="fused_sgd")
    )
    assert codes(advisor) == []
    assert advisor.figures is not None
    assert advisor.figures.num_updates == 4
    assert advisor.figures.curve == [(0, 1024.0), (3, 1024.0)]  # the second run's scale, held to its last step
    assert advisor.figures.skipped == []
    assert advisor.figures.precision == "16-mixed"


def test_the_advise_command_gives_what_the_logged_series_support(tmp_path, capsys):
    from lightning_amp_plus.__main__ import main

    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**40, max_scale=2.0**40)
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=5), advisor],
        logger=logger,
        max_steps=30,
    ).fit(TinyModel(optimizer="fused_sgd", lr=0.01))
    leading = plugin.history.skipped_steps
    capsys.readouterr()
    assert main(["advise", logger.log_dir]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 finding from the logged series, most important first:"
    settled = plugin.history.scale_at(len(leading))
    assert out[1].startswith(f"1. [init_scale] The first {len(leading)} updates were skipped")
    # the run's own call (its logged `amp/plugin`) with one change: max_scale kept, as the live advisor keeps it
    exponent = int(torch.tensor(settled).log2())
    assert out[2] == f'    fix: AmpPlusPrecision("16-mixed", init_scale=2.0**{exponent}, max_scale=2.0**40)'
    assert out[2] == f"    fix: {next(a.fix for a in advisor.advice if a.code == 'init_scale')}"
    assert out[3] == (
        "not checked (they need the live callback, `AmpAdvisor`): nonfinite_loss, model_nonfinite, fp32_module,"
        " own_code, backward_skips, nonfinite_batches, zero_gradients, max_scale, silent_fp32, fused_optimizer"
    )


def test_the_advise_command_without_amp_series_is_one_error_line(tmp_path, capsys):
    from lightning_amp_plus.__main__ import main

    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,1.0\n")
    assert main(["advise", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: ")
    assert "LossScaleMonitor" in err[0]


def test_tensorboard_gets_the_count_and_the_text(fused_saves, tmp_path):
    fused_saves(1.0)
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], logger=logger, max_steps=4
    ).fit(TinyModel(optimizer="adamw", poison={0: "inf", 1: "inf", 2: "nan"}))
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("amp/advice")] == [(3, 1.0)]  # the findings: a hint is none
    (text,) = acc.Tensors("amp/advice/text_summary")
    assert "## `nonfinite_loss`" in text.tensor_proto.string_val[0].decode()
    assert "## Speed hints\n\n- `fused_optimizer`" in text.tensor_proto.string_val[0].decode()
    assert text.step == 3  # the last update's step, like the count


def test_any_logger_gets_the_count_and_only_tensorboard_the_text(fused_saves, tmp_path):
    """A minimal logger (no ``experiment``) gets the count; another logger's ``add_text`` is not TensorBoard's."""
    fused_saves(1.0)  # one finding and one hint, whatever this machine's timings
    from lightning.pytorch.loggers import Logger

    class Minimal(Logger):
        name, version = "minimal", 0

        def __init__(self):
            super().__init__()
            self.metrics = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    class Texts(Minimal):
        def __init__(self):
            super().__init__()
            self.texts = []
            self.experiment = type("Writer", (), {"add_text": lambda _, *args, **kw: self.texts.append(args)})()

    minimal, texts = Minimal(), Texts()
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[advisor],
        logger=[minimal, texts],
        max_steps=4,
    ).fit(TinyModel(optimizer="adamw", poison={0: "inf", 1: "inf", 2: "nan"}))
    for logger in (minimal, texts):
        assert [(step, m["amp/advice"]) for step, m in logger.metrics if "amp/advice" in m] == [(3, 1.0)]
    assert texts.texts == []


@pytest.mark.parametrize("advisor_first", [True, False])
def test_the_advice_does_not_depend_on_the_callback_order(advisor_first):
    advisor, reporter = AmpAdvisor(print_advice=False), NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    callbacks = [advisor, reporter] if advisor_first else [reporter, advisor]
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=callbacks, max_steps=6).fit(
        Overflowing()  # fused: every skip decided on the device
    )
    assert codes(advisor) == ["fp32_module"]
    assert only(advisor, "fp32_module").evidence["told"] == 5  # the first one, read from the loss, starts the watch


def test_a_run_that_skipped_every_update_is_not_healthy():
    poison = {i: "net.0.weight" for i in range(8)}
    advisor, plugin = fit(TinyModel(optimizer="fused_sgd", grad_poison=poison), max_steps=8)
    assert plugin.history.num_skipped == 8
    assert codes(advisor) == ["skip_rate"]
    evidence = only(advisor, "skip_rate").evidence
    assert {k: evidence[k] for k in ("skipped", "updates", "rate", "trailing_streak")} == {
        "skipped": 8,
        "updates": 8,
        "rate": 1.0,
        "trailing_streak": 8,
    }


def test_a_failed_setup_prints_no_advice(tmp_path, caplog):
    caplog.set_level("WARNING", logger="lightning_amp_plus")
    target = tmp_path / "folder.md"
    target.mkdir()  # a folder where the report should go: refused at setup
    with pytest.raises(ValueError, match="report_path"):
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed")], callbacks=[AmpAdvisor(report_path=target)], max_steps=2
        ).fit(TinyModel())
    assert not [r for r in caplog.records if r.getMessage().startswith("AmpAdvisor")]


def test_the_printed_and_markdown_text(fused_saves, tmp_path, caplog):
    fused_saves(1.0)
    caplog.set_level("WARNING", logger="lightning_amp_plus")
    advisor = AmpAdvisor(report_path=tmp_path / "a.md")
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], max_steps=3).fit(
        TinyModel(optimizer="adamw", poison={0: "inf", 1: "inf", 2: "nan"})
    )
    assert [a.code for a in advisor.advice] == ["nonfinite_loss"]
    assert [a.code for a in advisor.hints] == ["fused_optimizer"]  # a speed hint is no finding
    (first,), (hint,) = advisor.advice, advisor.hints
    (printed,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpAdvisor")]
    assert printed == "\n".join(
        [
            "AmpAdvisor: 1 finding, most important first:",
            f"1. [nonfinite_loss] {first.message}\n    fix: {first.fix}",
            f"speed hint [fused_optimizer]: {hint.message} Fix: {hint.fix}",
        ]
    )
    assert len(printed.splitlines()[-1]) < 270  # one short line, not a paragraph
    assert (tmp_path / "a.md").read_text() == "\n".join(
        [
            "# AmpAdvisor",
            "",
            "## `nonfinite_loss`",
            "",
            first.message,
            "",
            "```python",
            first.fix,
            "```",
            "",
            "Evidence: `input`: 0, `loss`: 2, `told`: 2",
            "",
            "",
            "## Speed hints",
            "",
            f"- `fused_optimizer`: {hint.message} Fix: `{hint.fix}`",
            "",
        ]
    )
    one = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[one], max_steps=2).fit(
        TinyModel(optimizer="adamw")
    )
    verdict, line = one.format().splitlines()
    assert verdict.startswith("AmpAdvisor: the run looks healthy: 2 updates")  # the verdict stays about health
    assert line.startswith("speed hint [fused_optimizer]: ")


def test_a_speed_hint_keeps_a_json_report_healthy(fused_saves, tmp_path):
    fused_saves(1.0)
    advisor = AmpAdvisor(report_path=tmp_path / "a.json", print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor], max_steps=3).fit(
        TinyModel(optimizer="adamw")
    )
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["healthy"] is True
    assert report["advice"] == []
    assert [a["code"] for a in report["speed"]] == ["fused_optimizer"]


def test_what_the_advisor_gathers_in_bf16():
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[advisor], max_steps=3).fit(
        TinyModel(optimizer="fused_sgd")
    )
    figures = advisor.figures
    assert (figures.precision, figures.curve, figures.knobs, figures.underflow) == ("bf16-mixed", [], None, None)
    assert (figures.num_updates, figures.last_step, figures.skipped, figures.bf16_available) == (3, 2, [], True)
    assert figures.fp32_rows == []  # inspected: nothing heavy in float32
    assert figures.non_fused == []
    theirs = GradUnderflowMonitor()  # the user's monitor in a bf16 run: no loss scale, so no underflow figures
    advisor = AmpAdvisor(print_advice=False)
    with pytest.warns(AmpPlusWarning, match="measures nothing"):
        make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[theirs, advisor], max_steps=3).fit(
            TinyModel(optimizer="fused_sgd")
        )
    assert advisor.figures.underflow is None


@pytest.mark.parametrize(
    ("optimizer", "plugin", "expected"),
    [
        ("adamw", AmpPlusPrecision("bf16-mixed", skip_nonfinite=False), [{"name": "AdamW", "device": "cpu"}]),
        ("adamw", AmpPlusPrecision("bf16-mixed"), [{"name": "AdamW", "device": "cpu"}]),
        ("adam", AmpPlusPrecision("16-mixed"), [{"name": "Adam", "device": "cpu"}]),
        ("sgd", AmpPlusPrecision("16-mixed"), [{"name": "SGD", "device": "cpu"}]),
        ("fused_sgd", AmpPlusPrecision("16-mixed"), []),
    ],
)
def test_which_optimizers_count_as_non_fused(optimizer, plugin, expected):
    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=3).fit(TinyModel(optimizer=optimizer))
    assert named(advisor.figures.non_fused) == expected
    for o in advisor.figures.non_fused:  # timed both ways, against the run's own step
        assert o["step_ms"] > 0
        assert o["fused_step_ms"] > 0
        assert o["train_step_ms"] > 0
        assert o["pairs"] == 9
        assert o["gain_low_ms"] <= o["gain_ms"]


def test_a_users_own_optimizer_class_is_not_told_to_fuse():
    class MyAdamW(torch.optim.AdamW):  # defined outside torch.optim: its step is the user's
        pass

    class Model(TinyModel):
        def configure_optimizers(self):
            return MyAdamW(self.parameters(), lr=0.01)

    advisor = AmpAdvisor(print_advice=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor], max_steps=2).fit(Model())
    assert advisor.figures.non_fused == []


def test_which_optimizers_are_told_to_fuse_one_rule_per_optimizer():
    """Told: a torch optimizer with a fused kernel for its device and float parameters, run non-fused."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    def params(device="cpu", dtype=torch.float32):
        return [torch.zeros(2, device=device, dtype=dtype)]

    class AdamW(torch.optim.AdamW):  # the user's own class of a fused optimizer's name
        pass

    embedding = torch.nn.Embedding(4, 2, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    sparse_params = list(embedding.parameters())

    optimizers = [
        torch.optim.SGD(params(), lr=0.1, fused=True),  # fused already
        torch.optim.AdamW(params(), lr=0.1),
        torch.optim.RMSprop(params(), lr=0.1),  # no fused kernel
        AdamW(params(), lr=0.1),
        torch.optim.SGD(params("meta"), lr=0.1),  # no fused kernel on that device
        torch.optim.SGD(params(dtype=torch.long), lr=0.1),  # fused kernels take float parameters only
        torch.optim.SGD(params() + params("meta"), lr=0.1),  # one of its devices has none
        torch.optim.SGD(params("meta") + params(), lr=0.1),
        LightningOptimizer(torch.optim.Adagrad(params(), lr=0.1)),  # as Lightning hands it over
        torch.optim.Adagrad(params("meta"), lr=0.1),  # Adagrad's fused kernel is CPU-only
        torch.optim.SGD(params(), lr=0.1),
        torch.optim.SGD(sparse_params, lr=0.1),  # fused kernels refuse sparse gradients
    ]
    from lightning_amp_plus.callbacks._fused import candidates

    told = [{"name": "AdamW", "device": "cpu"}, {"name": "Adagrad", "device": "cpu"}, {"name": "SGD", "device": "cpu"}]
    assert named([entry for _, entry in candidates(optimizers)]) == told


def test_a_fused_fix_names_the_parameters_each_optimizer_has():
    """A GAN's optimizers each hold one submodule's parameters: a fix that wrote `self.parameters()` would make the
    generator's optimizer move the discriminator. A hand-picked list is named `params`, never guessed."""
    from lightning_amp_plus.callbacks._fused import candidates

    gan = nn.Module()
    gan.G, gan.D = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizers = [
        torch.optim.Adam(gan.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        torch.optim.Adam(gan.D.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        torch.optim.SGD(gan.parameters(), lr=0.1),
        torch.optim.SGD([gan.G.weight, gan.D[1].bias], lr=0.1),
    ]
    calls = [entry["fused_call"] for _, entry in candidates(optimizers, gan)]
    assert calls == [
        "torch.optim.Adam(self.G.parameters(), lr=0.0002, betas=(0.5, 0.999), fused=True)",
        "torch.optim.Adam(self.D.parameters(), lr=0.0002, betas=(0.5, 0.999), fused=True)",
        "torch.optim.SGD(self.parameters(), lr=0.1, fused=True)",
        "torch.optim.SGD(params, lr=0.1, fused=True)  # params: the parameters (or groups) your call passes",
    ]
    pasted = eval(calls[0], {"torch": torch, "self": gan})  # as printed: the generator's parameters only
    assert {id(p) for p in pasted.param_groups[0]["params"]} == {id(p) for p in gan.G.parameters()}
    gan.heads = nn.ModuleDict({"a-b": nn.Linear(2, 2), "class": nn.Linear(2, 2)})
    indexed = [gan.D[1], gan.heads["a-b"], gan.heads["class"]]
    calls = [entry["fused_call"] for _, entry in candidates([torch.optim.SGD(m.parameters()) for m in indexed], gan)]
    assert calls[0] == "torch.optim.SGD(self.D[1].parameters(), fused=True)"  # not `self.D.1`, no Python
    assert calls[1] == 'torch.optim.SGD(self.heads["a-b"].parameters(), fused=True)'
    for call, module in zip(calls, indexed, strict=True):  # each pastes, and optimizes that submodule's own
        pasted = eval(call, {"torch": torch, "self": gan})
        assert {id(p) for p in pasted.param_groups[0]["params"]} == {id(p) for p in module.parameters()}


def test_bf16_availability_by_device(monkeypatch):
    from lightning_amp_plus.callbacks._common import bf16_available as _bf16_available

    assert [_bf16_available(d) for d in ("cpu", "xpu", "mps", "hpu", "meta")] == [True, True, True, True, False]
    assert _bf16_available("cuda") == bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    for available, supported in [(True, True), (True, False), (False, False)]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, supported=supported, **kw: supported)
        assert _bf16_available("cuda") is (available and supported)


def _write_series(path, columns):
    """A metrics.csv of `columns` ({key: [(step, value)]}), one row per step, as CSVLogger writes it."""
    steps = sorted({s for values in columns.values() for s, _ in values})
    table = {k: dict(v) for k, v in columns.items()}
    lines = ["step," + ",".join(columns)]
    lines += [f"{s}," + ",".join(str(table[k].get(s, "")) for k in columns) for s in steps]
    path.write_text("\n".join(lines) + "\n")


def test_the_advise_command_counts_its_findings_and_reads_a_curve_without_skips(tmp_path, capsys):
    from lightning_amp_plus.__main__ import main

    scale, curve, skips, isolated = 2.0**40, [], [], (100, 170, 240)
    for step in range(300):  # 10 leading skips, then three spikes, each regrown 31 updates later
        if step - 31 in isolated:
            scale *= 2
        curve.append((step, scale))
        skipped = step < 10 or step in isolated
        skips.append((step, float(skipped)))
        scale /= 2 if skipped else 1
    _write_series(tmp_path / "metrics.csv", {"amp/loss_scale": curve, "amp/step_skipped": skips})
    assert main(["advise", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 finding from the logged series, most important first:"
    assert out[1].startswith("1. [init_scale]")  # no hysteresis offline: without the cap a spike is not told

    stock = tmp_path / "stock"  # a stock plugin's sampled curve: a scale series and no skip series
    stock.mkdir()
    _write_series(stock / "metrics.csv", {"amp/loss_scale": [(1, 1024.0), (3, 1024.0), (6, 2048.0)]})
    assert main(["advise", str(stock)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("no finding in the logged series: ")


class Calls(TinyModel):
    """Its optimizer is built from a line of code, so a printed fix can be pasted in as printed."""

    def __init__(self, call, scheduler_interval=None, **kwargs):
        super().__init__(**kwargs)
        self.call = call
        self.scheduler_interval = scheduler_interval

    def training_step(self, batch, batch_idx):  # no host read of its own: the syncs counted are the step's
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        pass

    def configure_optimizers(self):
        opt = eval(self.call, {"torch": torch, "self": self})
        if self.scheduler_interval is None:
            return opt
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}


def syncs_per_step(model_factory, plugin_factory=lambda: AmpPlusPrecision("16-mixed", init_scale=1024.0)):
    from lightning_amp_plus.syncs import HostSyncCounter

    counts = []
    for steps in (4, 12):
        with HostSyncCounter() as counter:
            make_trainer(plugins=[plugin_factory()], max_steps=steps).fit(model_factory())
        counts.append(counter.count)
    return (counts[1] - counts[0]) / 8


SGD_MOMENTUM = "torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)"


def test_the_fused_optimizer_fix_keeps_the_users_settings(fused_saves):
    fused_saves(1.0)
    advisor, _ = fit(Calls(SGD_MOMENTUM), max_steps=3)
    advice = only(advisor, "fused_optimizer")
    assert advice.fix == "torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=True)"
    fixed = Calls(advice.fix)
    fixed_advisor, _ = fit(fixed, max_steps=3)
    assert "fused_optimizer" not in codes(fixed_advisor)
    assert fixed.trainer.optimizers[0].defaults["momentum"] == 0.9  # the user's momentum is kept
    assert fixed.trainer.optimizers[0].defaults["fused"] is True
    # and the trade-off the advice states, measured: a fused step's skip is read from the device, once a step
    assert syncs_per_step(lambda: Calls(SGD_MOMENTUM)) == 1.0
    assert syncs_per_step(lambda: Calls(advice.fix)) == 0.0


def test_several_param_groups_keep_their_groups_in_the_fused_fix(fused_saves):
    fused_saves(1.0)
    call = "torch.optim.AdamW([{'params': self.net[0].parameters()}, {'params': self.net[2].parameters()}], lr=0.01)"
    advisor, _ = fit(Calls(call), max_steps=2)
    assert (
        only(advisor, "fused_optimizer").fix
        == "torch.optim.AdamW(params, lr=0.01, fused=True)  # params: the parameters (or groups) your call passes"
    )


def test_skip_rate_is_told_even_when_a_speed_hint_is_given(fused_saves):
    fused_saves(1.0)
    poison = {i: "net.0.weight" for i in range(10)}
    advisor, plugin = fit(TinyModel(optimizer="sgd", grad_poison=poison), max_steps=10)
    assert plugin.history.num_skipped == 10
    assert codes(advisor) == ["skip_rate", "fused_optimizer"]  # the skips first: a speed hint explains none


class Dead(TinyModel):
    """`loss * 1e-14`: every gradient below float16's range at any scale up to max_scale (flushed to zero)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-14


def _deltas(model, plugin, max_steps=8, callbacks=()):
    before = [p.detach().clone() for p in model.parameters()]
    advisor = AmpAdvisor()
    make_trainer(plugins=[plugin], callbacks=[advisor, *callbacks], max_steps=max_steps, log_every_n_steps=2).fit(model)
    return advisor, [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def test_a_dead_run_is_not_called_healthy_without_a_rerun_and_the_reference_it_points_to_revives_it():
    torch.manual_seed(0)
    advisor, deltas = _deltas(Dead(optimizer="fused_sgd", lr=1e12), AmpPlusPrecision("16-mixed"))
    assert all(not d.any() for d in deltas)  # the optimizer consumed zeros: nothing trained
    assert all(m["zero_fraction"] == 1.0 and m["underflow_fraction"] is None for m in advisor.figures.underflow)
    assert "looks healthy" not in advisor.format()
    assert codes(advisor) == ["zero_gradients"]  # told without running training_step again
    advice = only(advisor, "zero_gradients")
    assert "exactly zero" in advice.message
    assert "flushed" in advice.message
    # its fix, pasted as printed: the float32 reference, which measures the scale that keeps them
    monitor = eval(advice.fix.split("  #")[0], {"GradUnderflowMonitor": GradUnderflowMonitor})
    assert monitor.exact
    torch.manual_seed(0)
    referenced, _ = _deltas(Dead(optimizer="fused_sgd", lr=1e12), AmpPlusPrecision("16-mixed"), callbacks=[monitor])
    fractions = [m["underflow_fraction"] for m in referenced.figures.underflow]
    assert fractions
    assert min(fractions) >= 0.9  # measured against float32: flushed, not structural
    assert "zero_gradients" not in codes(referenced)
    (scale_advice,) = [a for a in referenced.advice if a.code == "max_scale"]
    fixed_plugin = applied(scale_advice.fix)
    assert fixed_plugin.scaler.get_scale() > 2.0**24  # beyond the default cap
    torch.manual_seed(0)
    fixed, fixed_deltas = _deltas(
        Dead(optimizer="fused_sgd", lr=1e12), fixed_plugin, callbacks=[GradUnderflowMonitor(exact=True)]
    )
    assert all(d.any() for d in fixed_deltas)  # the gradients reach the optimizer
    assert max(m["underflow_fraction"] for m in fixed.figures.underflow) < 0.05
    assert "max_scale" not in codes(fixed)


def test_a_dead_run_shorter_than_the_logging_interval_is_measured_too():
    """The advisor's own measurement also takes the fit's first update: a 10-step fit (Lightning logs every 50) is
    read, not called healthy for want of a measurement."""
    torch.manual_seed(0)
    advisor = AmpAdvisor()
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[advisor], max_steps=10).fit(
        Dead(optimizer="fused_sgd", lr=1e12)
    )
    assert [m["step"] for m in advisor.figures.underflow] == [0]
    assert codes(advisor) == ["zero_gradients"]
    assert "looks healthy" not in advisor.format()
    mine = GradUnderflowMonitor()  # a user's monitor measures on logging steps only, as documented
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[mine], max_steps=10).fit(Dead())
    assert mine.measurements == []


class Quiet(TinyModel):
    """A healthy look-alike of the dead run: a loss of exactly 0 (nothing to learn) also has all-zero gradients."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 0.0


def test_all_zero_gradients_with_a_zero_loss_are_not_called_flushed():
    advisor, _ = _deltas(Quiet(optimizer="fused_sgd"), AmpPlusPrecision("16-mixed"))
    assert all(m["zero_fraction"] == 1.0 for m in advisor.figures.underflow)
    assert "zero_gradients" not in codes(advisor)


class Sparse(TinyModel):
    """An embedding of 80 rows of which each batch uses 8: 90% of its gradient is structurally zero."""

    def __init__(self, **kwargs):
        super().__init__(optimizer="fused_sgd", **kwargs)
        self.embed = nn.Embedding(80, 8)

    def forward(self, x):
        return self.net(self.embed((x.abs() * 3).long().clamp(max=7)).sum(dim=1))


def test_an_embedding_run_with_unused_rows_reads_no_underflow_and_gets_no_advice():
    monitor = GradUnderflowMonitor(per_parameter=10)
    advisor, _ = _deltas(
        Sparse(), AmpPlusPrecision("16-mixed", init_scale=1024.0, growth_interval=1000), callbacks=[monitor]
    )
    measured = advisor.figures.underflow
    assert measured
    assert all(m["underflow_fraction"] <= 0.05 for m in measured)
    for m in measured:  # the embedding's gradient (90% structural zeros) is made in float32: not counted
        assert "embed.weight" not in {w["name"] for w in m["worst"]}
    assert advisor.advice == []


def test_advice_that_fails_never_ends_a_fit_that_trained(monkeypatch):
    from lightning_amp_plus.callbacks import advisor as advisor_module

    def broken(figures):
        raise ZeroDivisionError("a rule's bug")

    monkeypatch.setattr(advisor_module, "advise", broken)
    advisor = AmpAdvisor()
    plugin = AmpPlusPrecision("16-mixed")
    with pytest.warns(AmpPlusWarning, match=r"`AmpAdvisor`: no advice for this fit \(ZeroDivisionError"):
        make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=3).fit(TinyModel())
    assert plugin.history.num_steps == 3


class Adapted(TinyModel):
    """A frozen backbone behind a trainable adapter fed inputs near 2e-6: the adapter's weight gradients are tiny,
    the gradients flowing through the backbone's activations about 10^5 times larger."""

    def __init__(self):
        super().__init__(optimizer="fused_sgd", lr=0.0)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.backbone = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 1))
        with torch.no_grad():
            self.backbone[0].weight.mul_(3.0)
            self.backbone[1].weight.mul_(3.0)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.backbone(self.adapter(x * 2e-6))

    def configure_optimizers(self):
        return torch.optim.SGD(self.adapter.parameters(), lr=0.0, fused=True)


def test_a_fitting_scale_fits_the_activations_gradients_too():
    import math

    def run(plugin, steps, callbacks=()):
        advisor = AmpAdvisor(print_advice=False)
        make_trainer(plugins=[plugin], callbacks=[advisor, *callbacks], max_steps=steps, log_every_n_steps=2).fit(
            Adapted()
        )
        return advisor, plugin

    # at the floor with the adapter's gradients all subnormal: the warning says so, as it should
    with pytest.warns(AmpPlusWarning, match="underflow float16 while the loss scale sits at min_scale"):
        advisor, _ = run(
            AmpPlusPrecision("16-mixed", init_scale=1.0, max_scale=1.0), 12, [GradUnderflowMonitor(exact=True)]
        )
    advice = only(advisor, "max_scale")
    fitting = advice.evidence["fitting_scale"]
    # the weights' own gradients would "fit" a far higher scale: the activations' bound it
    weights_headroom = min(m["headroom_bits"] for m in advisor.figures.underflow)
    assert math.log2(fitting) < weights_headroom - 10
    fixed, fixed_plugin = run(applied(advice.fix), 60)
    assert fixed_plugin.history.num_skipped == 0  # applied as printed: the backward never overflows
    assert max(m["underflow_fraction"] for m in fixed.figures.underflow) < 0.1  # was 1.0: the adapter's gradients live
    # the scale the weights alone fit, applied the same way: the backward overflows and skips
    weights_only = 2.0 ** (math.floor(weights_headroom) - 1)
    _, overflowing = run(AmpPlusPrecision("16-mixed", init_scale=weights_only, max_scale=weights_only), 20)
    assert overflowing.history.num_skipped >= 10


class NaNTargets(TinyModel):
    """A regression whose targets hold NaN at some rows (missing labels): they reach only the loss."""

    def __init__(self, rows):
        super().__init__(optimizer="sgd")
        self.rows = rows

    def train_dataloader(self):
        loader = make_loader(n=48, batch_size=4)
        x, y = loader.dataset.tensors
        y = y.clone()
        for row in self.rows:
            y[row] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def test_nan_targets_that_reach_only_the_loss_get_the_batch_guard_not_a_float32_loss():
    advisor, plugin = fit(NaNTargets(rows=(5, 13, 22)))
    assert plugin.history.skipped_steps == [1, 3, 5]  # with the loss in float32 already (`out.float()`): no help
    advice = only(advisor, "nonfinite_loss")
    assert advice.evidence == {"input": 1, "loss": 2, "told": 3}  # the first one read before the watch: the batch's
    assert "the batch held inf/nan there" in advice.message
    assert "torch.isfinite" in advice.fix
    model = NaNTargets(rows=(5, 13, 22))
    step = model.training_step

    def guarded(batch, batch_idx):
        exec(advice.fix, {"torch": torch, "batch": batch})  # the fix as printed, first line of training_step
        return step(batch, batch_idx)

    model.training_step = guarded
    with pytest.raises(AssertionError, match="inf/nan in the batch"):  # it stops at the bad batch, not silently
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], max_steps=4).fit(model)


def test_the_fused_fix_is_the_users_own_call_or_its_values():
    from lightning.pytorch import LightningModule
    from torch import nn

    from lightning_amp_plus.callbacks._fused import candidates

    class Gan(LightningModule):
        def __init__(self):
            super().__init__()
            self.generator, self.critic = nn.Linear(2, 2), nn.Linear(2, 1)
            self.lr = 3e-3

        def configure_optimizers(self):
            beta = 0.5
            return (
                torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(beta, 0.999)),
                torch.optim.Adam(
                    self.critic.parameters(),
                    lr=self.lr * 4,
                ),
            )

    class Built(Gan):
        def configure_optimizers(self):
            return make(self)  # built elsewhere: no call to copy

    def make(module):
        return torch.optim.Adam(module.generator.parameters(), lr=module.lr)

    gan = Gan()
    fixes = [entry["fused_call"] for _, entry in candidates(list(gan.configure_optimizers()), gan)]
    assert fixes == [
        "torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(beta, 0.999), fused=True)",
        "torch.optim.Adam(self.critic.parameters(), lr=self.lr * 4, fused=True)",  # picked by what it optimizes
    ]
    built = Built()
    ((_, entry),) = candidates([built.configure_optimizers()], built)
    assert entry["fused_call"] == "torch.optim.Adam(self.generator.parameters(), lr=0.003, fused=True)"  # the values


def test_the_fused_fix_copies_only_a_call_that_built_the_optimizer_and_stays_valid_python():
    from lightning.pytorch import LightningModule
    from torch import nn

    from lightning_amp_plus.callbacks._fused import candidates

    def fixes(module):
        made = module.configure_optimizers()
        made = made if isinstance(made, list) else [made]
        found = [entry["fused_call"] for _, entry in candidates(made, module)]
        for fix in found:  # each one pastes: valid Python that builds the optimizer fused
            built = eval(fix.split("  #")[0], {"torch": torch, "self": module, "beta": 0.5})
            assert built.defaults["fused"] is True
        return found

    class Base(LightningModule):
        def __init__(self):
            super().__init__()
            self.gen, self.disc = nn.Linear(2, 2), nn.Linear(2, 1)
            self.lr = 2e-4

    def disc_optimizer(module):
        return torch.optim.Adam(module.disc.parameters(), lr=1e-3)

    class Gan(Base):
        def configure_optimizers(self):  # the critic's is built in a helper: its call is not this one
            return [torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999)), disc_optimizer(self)]

    assert fixes(Gan()) == [
        "torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=True)",
        "torch.optim.Adam(self.disc.parameters(), fused=True)",  # its values (Adam's defaults), not the gen's call
    ]

    def tuned(module):
        return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.3)

    class DeadBranch(Base):
        def configure_optimizers(self):
            if self.lr > 1:  # never runs
                return torch.optim.AdamW(self.parameters(), lr=1.0, weight_decay=0.0)
            return tuned(self)

    (fix,) = fixes(DeadBranch())
    assert "weight_decay=0.3" in fix  # the values it ran with, not the dead branch's
    assert "lr=1.0" not in fix

    class Unfused(Base):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=False, foreach=None)

    assert fixes(Unfused()) == ["torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)"]

    class Splat(Base):
        def configure_optimizers(self):
            settings = {"lr": self.lr, "foreach": True}
            return torch.optim.AdamW(self.parameters(), **settings)  # may hold fused or foreach: not copied

    (fix,) = fixes(Splat())
    assert "**" not in fix
    assert "foreach" not in fix

    class Commented(Base):
        def configure_optimizers(self):
            return torch.optim.AdamW(
                [
                    {"params": self.gen.parameters(), "weight_decay": 0.1},  # matrices
                    {"params": self.disc.parameters(), "weight_decay": 0.0},  # biases
                ],
                lr=self.lr,
                betas=(0.9,  # momentum
                       0.95),
            )  # fmt: skip

    (fix,) = fixes(Commented())
    assert "#" not in fix
    assert "lr=self.lr" in fix
    assert "betas=(0.9, 0.95)" in fix

    class LeftOut(Base):
        def configure_optimizers(self):  # the branch that ran builds it elsewhere, with weight_decay=0.3
            if self.lr > 0:
                return tuned(self)
            return torch.optim.AdamW(self.parameters(), lr=self.lr)  # never runs: its weight_decay is AdamW's 0.01

    (fix,) = fixes(LeftOut())
    assert "weight_decay=0.3" in fix

    class Listed(Base):
        def configure_optimizers(self):
            sweep = torch.optim.AdamW(self.parameters(), lr=self.lr)  # noqa: F841 - a leftover, never returned
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=[0.9, 0.95])  # torch keeps a list

    assert fixes(Listed()) == ["torch.optim.AdamW(self.parameters(), lr=self.lr, betas=[0.9, 0.95], fused=True)"]

    class Spaced(Base):
        def configure_optimizers(self):
            return torch.optim.SGD(
                self.parameters(),
                lr=0.1,
                dampening={"a  b": 0.0}["a  b"],
            )

    (fix,) = fixes(Spaced())
    assert '{"a  b": 0.0}["a  b"]' in fix  # a string's spaces as written


def test_a_resumed_fit_advises_as_the_uninterrupted_one(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_origins import Stack

    def fit(steps, ckpt_path=None, checkpoint=None):
        torch.manual_seed(0)
        advisor = AmpAdvisor(print_advice=False)
        callbacks = [advisor, *([checkpoint] if checkpoint is not None else [])]
        trainer = make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
            callbacks=callbacks,
            max_steps=steps,
            enable_checkpointing=checkpoint is not None,
        )
        trainer.fit(Stack(), ckpt_path=ckpt_path)
        return [(r["step"], r["origin"]) for r in advisor._reporter.skips], [(a.code, a.fix) for a in advisor.advice]

    whole = fit(4)
    fit(2, checkpoint=ModelCheckpoint(dirpath=tmp_path, save_last=True))
    resumed = fit(4, ckpt_path=str(tmp_path / "last.ckpt"), checkpoint=ModelCheckpoint(dirpath=tmp_path / "again"))
    assert resumed[0][:2] == whole[0][:2]  # the skips before the checkpoint keep their origins (a fused optimizer's)
    assert [step for step, _ in resumed[0]] == [0, 1, 2, 3]  # (the resumed epoch restarts its batches: Lightning's)
    assert resumed[1] == whole[1]  # and the fix is the same
    assert [code for code, _ in whole[1]] == ["fp32_module"]


def test_the_fused_fix_reads_settings_passed_by_position():
    from lightning.pytorch import LightningModule

    from lightning_amp_plus.callbacks._fused import candidates

    class Positional(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)
            self.lr = 3e-3  # not Adam's default: a call that left it out did not build the optimizer

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), self.lr)

    class Literal(Positional):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 0.01, (0.5, 0.9))

    for module, fix in [
        (Positional(), "torch.optim.Adam(self.parameters(), self.lr, fused=True)"),
        (Literal(), "torch.optim.Adam(self.parameters(), 0.01, (0.5, 0.9), fused=True)"),
    ]:
        ((_, entry),) = candidates([module.configure_optimizers()], module)
        assert entry["fused_call"] == fix


def test_the_fused_fix_copies_neither_of_two_calls_that_could_have_built_the_optimizer():
    from lightning.pytorch import LightningModule

    from lightning_amp_plus.callbacks._fused import candidates

    class Branches(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)
            self.lr, self.warm = 3e-3, False

        def configure_optimizers(self):
            if self.warm:
                return torch.optim.Adam(self.parameters(), lr=self.lr * 10)
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    module = Branches()
    ((_, entry),) = candidates([module.configure_optimizers()], module)
    assert entry["fused_call"] == "torch.optim.Adam(self.parameters(), lr=0.003, fused=True)"  # the values it ran with


def _one_nan_record(nan):
    """12 batches of 4 rows; with ``nan``, one record of the 5th batch (step 4) holds a NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    if nan:
        x[17, 3] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) * 0.1), batch_size=4)


class Guarded(Overflowing):
    """The printed guard, pasted as the first line of ``training_step``."""

    def training_step(self, batch, batch_idx):
        assert all(torch.isfinite(t).all() for t in batch if torch.is_tensor(t) and t.is_floating_point()), (
            "inf/nan in the batch"
        )
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("nan", [True, False])
def test_a_nan_record_among_forward_overflows_gets_a_line_of_its_own_and_its_guard_finds_the_batch(nan):
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, min_scale=0.0)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=12).fit(Overflowing(), _one_nan_record(nan))
    if not nan:  # the healthy look-alike of this finding: every skip a forward overflow
        assert "nonfinite_batches" not in codes(advisor)
        return
    assert codes(advisor)[:2] == ["fp32_module", "nonfinite_batches"]  # each problem its line, the larger first
    advice = only(advisor, "nonfinite_batches")
    assert advice.message.startswith(
        "1 of 11 skipped updates told (12 skipped in all) was born in the batch (step 4): the data held inf/nan"
    )
    guard = AmpPlusPrecision("16-mixed", init_scale=1024.0, min_scale=0.0)
    with pytest.raises(AssertionError, match="inf/nan in the batch"):  # the guard, pasted, stops at that batch
        make_trainer(plugins=[guard], max_steps=12).fit(Guarded(), _one_nan_record(nan))
    assert guard.history.num_steps == 4  # steps 0 to 3 ran: the record is in batch 4


class _Cubed(torch.nn.Module):
    def forward(self, h):
        return h * h * h  # float16 overflow on a loud batch


class _CubedModel(TinyModel):
    def __init__(self):
        super().__init__(lr=1e-3)
        self.l1, self.cube, self.l2 = nn.Linear(8, 16), _Cubed(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.l2(self.cube(self.l1(x))).float() - y).square().mean()


@pytest.mark.parametrize("loud", [(), (0,), (1,), (20,)])
def test_a_forward_skip_inside_the_settling_row_leaves_init_scale_said_and_skip_rate_silent(loud):
    """Third break pass: one forward-born skip at step 0 or 1 broke the scale's leading row, so `init_scale` went
    silent and the settling skips after it were called "10 more ... No rule here explains why". The row steps over a
    skip no loss scale causes: the same `init_scale` as the clean run, and `fp32_module` beside it."""
    from tests.helpers.models import loud_batches
    from tests.helpers.trainer import watched_fit

    _, advisor = watched_fit(_CubedModel, loud_batches(60, loud, 300.0), 60, init_scale=2.0**24)
    assert codes(advisor) == (["fp32_module", "init_scale"] if loud else ["init_scale"])
    (said,) = [a for a in advisor.advice if a.code == "init_scale"]
    assert said.evidence["settled_scale"] == 2.0**13  # the clean run's (loud=())
    # the forward-born skip inside the row is said apart from the scale's
    assert said.message.startswith("The first" if loud in [(), (20,)] else "3 of the first 4 updates")
