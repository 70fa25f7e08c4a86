import json
import re
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleCollapseError, NaNSkipReporter
from lightning_amp_plus.forensics.origin import EARLIER_MICRO_BATCH, WATCHING
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer


def test_names_exactly_the_poisoned_parameter(tmp_path, caplog):
    model = TinyModel(grad_poison={3: "net.0.weight"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    reporter = NaNSkipReporter(report_path=tmp_path / "skips.json")
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=6).fit(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_amp_plus"]
    assert re.fullmatch(
        r"step 3 skipped: born in backward \(the loss was finite\); gradients non-finite"
        r" in net.0.weight \(\d+ inf.*, loss scale 1024 -> 512",
        lines[0],
    )
    assert lines[1] == "`NaNSkipReporter`: 1 of 6 updates skipped (at step 3); worst offenders: net.0.weight (1 skip)."
    assert [r["step"] for r in reporter.skips] == [3]
    record = reporter.skips[0]
    assert [o["name"] for o in record["offenders"]] == ["net.0.weight"]
    assert (
        record["offenders"][0]["inf"] + record["offenders"][0]["nan"] == model.net[0].weight.numel()
        or record["offenders"][0]["inf"] > 0
    )
    assert record["scale"] == 1024.0
    assert record["new_scale"] == 512.0
    assert record["loss"] is not None
    assert record["loss"] > 0
    assert record["origin"] == {"phase": "backward"}  # a gradient hook made the inf: forward and loss were finite
    report = json.loads((tmp_path / "skips.json").read_text())
    assert report["skips"] == json.loads(json.dumps(reporter.skips))
    assert report["skipped_steps"] == [3]
    assert report["worst_offenders"] == [{"name": "net.0.weight", "skips": 1}]


def test_nan_loss_names_every_parameter_and_no_loss(caplog):
    model = TinyModel(poison={1: "nan"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    reporter = NaNSkipReporter()
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=3).fit(model)
    assert any(r.getMessage().startswith("step 1 skipped") for r in caplog.records)
    (record,) = reporter.skips
    assert {o["name"] for o in record["offenders"]} == {n for n, _ in model.named_parameters()}
    assert all(o["nan"] > 0 for o in record["offenders"])
    assert record["loss"] == "nan"  # told apart from inf (JSON holds neither as a number)


def test_collapse_stops_within_six_steps_and_writes_no_checkpoint(tmp_path):
    model = TinyModel(poison={s: "inf" for s in range(100)})
    plugin = AmpPlusPrecision("16-mixed", min_scale=0.0)
    reporter = NaNSkipReporter(max_consecutive_skips=5, max_warnings=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(plugins=[plugin], callbacks=[reporter, ckpt], max_steps=50, enable_checkpointing=True)
    with pytest.raises(
        LossScaleCollapseError,
        # the loss is inf: the error says what AmpAdvisor says, not a scaling hint
        match=r"5 consecutive optimizer steps were skipped \(max_consecutive_skips=5\).*The loss was inf/nan with"
        r" every watched module output finite in 4 of 4 skipped updates told \(5 skipped in all\) \(born after the"
        r" last module call: in your"
        r" code after it, or in the loss function\): not a scaling problem"
        r".*HINT: loss = loss_fn\(",
    ):
        trainer.fit(model)
    assert len(reporter.skips) == 5
    assert trainer.global_step <= 6
    # the error comes inside the 5th skipped step, before its batch ends: no checkpoint of the collapsed state
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"epoch=0-step={s}.ckpt" for s in range(1, 5)]


def test_overflow_at_min_scale_is_a_collapse():
    model = TinyModel(poison={s: "inf" for s in range(100)})
    plugin = AmpPlusPrecision("16-mixed", init_scale=4.0, min_scale=1.0)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    with pytest.raises(
        LossScaleCollapseError,
        match=r"^Mixed-precision training collapsed: step 2 overflowed while the loss scale already sat at"
        r" min_scale=1 \(3 consecutive skipped steps\); loss scale 1; last offenders: net\.0\.weight, ",
    ):
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=50).fit(model)
    assert [r["scale"] for r in reporter.skips] == [4.0, 2.0, 1.0]


def test_one_skip_allowed_in_a_row_is_told_in_the_singular():
    reporter = NaNSkipReporter(max_consecutive_skips=1, max_warnings=0)
    with pytest.raises(
        LossScaleCollapseError,
        match=r"^Mixed-precision training collapsed: 1 consecutive optimizer step was skipped"
        r" \(max_consecutive_skips=1\); loss scale 1024; ",
    ):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter]).fit(
            TinyModel(poison={1: "inf"})
        )


def test_rate_limited_lines_then_summary(caplog):
    model = TinyModel(poison={s: "inf" for s in (1, 3, 5, 7)})
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**8, min_scale=2.0**-8)
    reporter = NaNSkipReporter(max_warnings=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=9).fit(model)
    assert not [w for w in caught if "skip" in str(w.message)]  # information goes to logging, not warnings
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_amp_plus"]
    assert [line.split(":")[0] for line in lines[:2]] == ["step 1 skipped", "step 3 skipped"]
    assert lines[2].startswith("`NaNSkipReporter`: 2 skipped steps printed; further skips are counted")
    assert lines[3].startswith("`NaNSkipReporter`: 4 of 9 updates skipped (at step 1, 3, 5, 7)")
    assert len(lines) == 4


def test_fused_optimizer_skips_are_found_at_the_flush(tmp_path):
    model = TinyModel(poison={2: "inf"}, optimizer="fused_adamw", lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    reporter = NaNSkipReporter(max_warnings=0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=5, log_every_n_steps=2).fit(model)
    assert [r["step"] for r in reporter.skips] == [2]
    # its flag read at the batch's end (on CPU at once): the gradients it refused are still there, no sync added
    assert [o["name"] for o in reporter.skips[0]["offenders"]] == [
        "net.0.weight",
        "net.0.bias",
        "net.2.weight",
        "net.2.bias",
    ]
    assert reporter.skips[0]["loss"] == "inf"
    assert reporter.skips[0]["new_scale"] == 512.0


def test_fused_optimizer_offenders_with_sync_fused():
    model = TinyModel(grad_poison={2: "net.2.weight"}, optimizer="fused_adamw", lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    reporter = NaNSkipReporter(sync_fused=True, max_warnings=0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=4).fit(model)
    assert [o["name"] for o in reporter.skips[0]["offenders"]] == ["net.2.weight"]


def test_bf16_skips_are_reported():
    model = TinyModel(grad_poison={1: "net.2.bias"})
    plugin = AmpPlusPrecision("bf16-mixed")  # no scale, no natural overflow
    reporter = NaNSkipReporter(max_warnings=0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=3).fit(model)
    assert [(r["step"], [o["name"] for o in r["offenders"]]) for r in reporter.skips] == [(1, ["net.2.bias"])]
    assert reporter.skips[0]["scale"] is None  # bf16 has no loss scale: none is shown


def test_skip_metrics_reach_the_logger(tmp_path):
    model = TinyModel(poison={2: "inf"})
    logger = CSVLogger(tmp_path)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[NaNSkipReporter(max_warnings=0)],
        logger=logger,
        max_steps=4,
    ).fit(model)
    with open(logger.experiment.metrics_file_path) as f:
        text = f.read()
    assert "amp/step_skipped" in text
    assert "amp/consecutive_skips" in text


def _warmup(opt):
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_warmup_is_not_consumed_by_skipped_steps(optimizer):
    model = TinyModel(poison={0: "inf", 5: "nan"}, scheduler=_warmup, optimizer=optimizer, lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    trainer = make_trainer(plugins=[plugin], max_steps=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 8
    assert plugin.applied_steps == 8
    assert trainer.global_step == 10


def test_stock_lightning_steps_the_scheduler_on_skipped_steps():
    from lightning.pytorch.plugins.precision import MixedPrecision

    model = TinyModel(poison={0: "inf", 5: "nan"}, scheduler=_warmup, lr=1e-3)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = make_trainer(plugins=[plugin], max_steps=10)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        trainer.fit(model)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 10


def test_scheduler_skipping_can_be_turned_off():
    model = TinyModel(poison={3: "inf"}, scheduler=_warmup, lr=1e-3)
    plugin = AmpPlusPrecision("16-mixed", skip_scheduler_on_overflow=False)
    trainer = make_trainer(plugins=[plugin], max_steps=6)
    trainer.fit(model)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6
    assert "lr_scheduler_step" not in model.__dict__  # the hook is restored at teardown


@pytest.mark.parametrize(
    ("kwargs", "error", "expected"),
    [
        ({"max_consecutive_skips": 0}, ValueError, "an int >= 1"),
        ({"max_warnings": -1}, ValueError, "an int >= 0"),
        ({"sync_fused": "no"}, TypeError, "a bool, got str"),
        ({"max_records": 1}, ValueError, "an int >= 2"),
        (
            {"find_origin": "yes"},
            ValueError,
            'True (observe, the default), "watch" (watch every module from the start), "replay" (also measure,'
            " running the module again) or False",
        ),
    ],
)
def test_bad_arguments(kwargs, error, expected):
    ((name, value),) = kwargs.items()
    with pytest.raises(error) as caught:
        NaNSkipReporter(**kwargs)
    assert str(caught.value) == f"`NaNSkipReporter({name}={value!r})` is invalid: expected {expected}."


def test_the_least_values_are_taken():
    reporter = NaNSkipReporter(max_consecutive_skips=1, max_warnings=0, max_records=2, find_origin=False)
    assert (reporter.max_consecutive_skips, reporter.max_records, reporter.find_origin) == (1, 2, False)


# ---------------------------------------------------------------------------------------------- where inf/nan is born
class _Born(TinyModel):
    """``big`` overflows float16 at the steps in ``at`` (its input is scaled up); ``own`` overflows between modules."""

    def __init__(self, at=(), own=False, **kwargs):
        super().__init__(**kwargs)
        self.at = set(at)
        self.own = own
        self.big = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.drop = torch.nn.Dropout(0.3)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        x = self.drop(self.bn(x))  # replayed before the overflow: random state and running statistics at stake
        if self.trainer.global_step in self.at:
            x = x * 1e6 if not self.own else x
        h = self.big(x)
        if self.own and self.trainer.global_step in self.at:
            h = h * 1e30  # the LightningModule's own code, between two children
        return self.net(self.norm(h))


@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
def test_origin_forward_names_the_module_whose_output_overflowed(caplog, optimizer):
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=6).fit(
        _Born(at=(2, 4), optimizer=optimizer)
    )
    assert reporter.skipped_steps == [2, 4]
    assert [r["origin"].get("module") for r in reporter.skips] == [None, "big"]  # the first one starts the watch
    assert all(r["origin"]["phase"] == "forward" and r["origin"]["kind"] in ("inf", "nan") for r in reporter.skips)
    if optimizer == "sgd":  # host-known skips are printed as they happen
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
        assert lines[0].startswith(
            "step 2 skipped: born in forward or in the loss (the loss was nan; no module named yet: every module is"
            " watched from the next step)"
        )
        assert lines[1].startswith("step 4 skipped: born in forward of big (")


def test_origin_in_the_modules_own_code_and_in_the_batch():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=4).fit(
        _Born(at=(1, 3), own=True)
    )
    assert [r["origin"] for r in reporter.skips][1:] == [{"phase": "forward", "module": "", "kind": "inf"}]

    class BadBatch(TinyModel):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx in (1, 3):
                x = x.clone()
                x[0, 0] = float("nan")
            return super().training_step((x, y), batch_idx)

    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=4).fit(
        BadBatch()
    )
    # the batch Lightning handed in was finite; the children's calls saw the nan first: the module's own code
    assert [r["origin"] for r in reporter.skips][1:] == [{"phase": "forward", "module": "", "kind": "nan"}]


def test_the_replay_leaves_training_unchanged_and_releases_the_inputs():
    def run(find_origin):
        torch.manual_seed(0)
        model = _Born(at=(2, 5))
        reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
        torch.manual_seed(1)
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=7).fit(
            model
        )
        return model, reporter

    plain, plain_reporter = run(False)
    told, told_reporter = run("replay")
    # dropout's random state and batch norm's statistics restored: the same losses (nan at the skips), bit for bit
    torch.testing.assert_close(torch.tensor(told.losses), torch.tensor(plain.losses), rtol=0, atol=0, equal_nan=True)
    for (name, a), (_, b) in zip(plain.state_dict().items(), told.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    assert [r["origin"] for r in plain_reporter.skips] == [None, None]
    assert [r["origin"]["module"] for r in told_reporter.skips] == ["big", "big"]
    assert told_reporter.origins.current is None  # the batch's inputs released
    assert all(not m._forward_pre_hooks for m in told.modules())  # removed at teardown


class _Masked(TinyModel):
    """A child receives an attention-style mask holding -inf by design; the overflow happens in backward."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attend = _Attend()

    def forward(self, x):
        mask = torch.zeros(x.shape[-1], device=x.device)
        mask[-1] = float("-inf")
        return self.net(self.attend(x, mask=mask))


class _Attend(torch.nn.Module):
    def forward(self, x, mask):
        return x * torch.softmax(x + mask, dim=-1)


def test_a_minus_inf_mask_is_not_an_origin():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=4).fit(
        _Masked(grad_poison={2: "net.0.weight"})
    )
    assert [r["origin"] for r in reporter.skips] == [{"phase": "backward"}]


class _BatchPoison(TinyModel):
    """``x[0, 0]`` set to ``value`` in the batches whose index is in ``at`` (as the data pipeline would)."""

    def __init__(self, at, value=float("-inf"), **kwargs):
        super().__init__(**kwargs)
        self.at, self.value = set(at), value

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx in self.at:
            batch[0][0, 0] = self.value


def _origins(model, find_origin=True, **trainer_kwargs):
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], **trainer_kwargs).fit(
        model
    )
    return [(r["step"], r["origin"]) for r in reporter.skips]


@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
def test_minus_inf_in_the_batch_is_an_input(optimizer):
    assert _origins(_BatchPoison({1}, optimizer=optimizer), max_steps=3) == [
        (1, {"phase": "input", "reason": WATCHING})
    ]
    watched = _origins(_BatchPoison({1}, optimizer=optimizer), "replay", max_steps=3)  # watched from the start
    assert watched == [(1, {"phase": "input"})]


@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
def test_accumulation_tells_the_last_micro_batch_and_nothing_it_cannot_see(optimizer):
    # batches 0,1 -> update 0; 2,3 -> update 1; 4,5 -> update 2
    first = _origins(_BatchPoison({2}, value=float("inf"), optimizer=optimizer), max_steps=3, accumulate_grad_batches=2)
    # an earlier micro-batch: not replayed, not called "backward"; its loss says it was born before backward
    assert [(step, told["phase"], told["reason"]) for step, told in first] == [(1, "forward", EARLIER_MICRO_BATCH)]
    last = _origins(_BatchPoison({3}, value=float("inf"), optimizer=optimizer), max_steps=3, accumulate_grad_batches=2)
    assert last == [(1, {"phase": "input", "reason": WATCHING})]  # the stepping micro-batch's, not the next one


class _GanLoss(TinyModel):
    """Manual optimization, two backward passes; the second loss is inf with every recorded module output finite."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x).float(), y))
        opt_a.step()
        opt_a.zero_grad()
        loss_b = torch.nn.functional.mse_loss(self.other(x).float(), y)
        if batch_idx in (1, 3):
            loss_b = loss_b * float("inf")
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.01), torch.optim.SGD(self.other.parameters(), lr=0.01)


def test_every_loss_of_the_batch_is_checked():
    assert _origins(_GanLoss(), max_steps=10) == [
        (1, {"phase": "forward", "kind": "inf", "reason": WATCHING}),  # the second loss read: it watches from then
        (3, {"phase": "loss"}),  # watched: every module's output finite
    ]


class _InPlace(TinyModel):
    def __init__(self):
        super().__init__()
        self.boom = _Boom()

    def forward(self, x):
        return self.net(self.boom(x))


class _Boom(torch.nn.Module):
    def forward(self, x):
        if x.abs().max() > 0 and getattr(self, "armed", False):
            x.mul_(1e30)  # changes its own input in place: finite in float32, beyond float16's range
        return x


def test_an_input_changed_in_place_is_not_misattributed():
    model = _InPlace()

    class Arm(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            model.boom.armed = batch_idx == 1

    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin="replay")
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[Arm(), reporter], max_steps=3
    ).fit(model)
    # boom's output (1e30, finite) is cast to float16 by net.0: the inf is born there, and float32 in net.0 moves it
    # on to net.2 (its float32 output is cast again), so the islands the fix needs are both, measured by replay
    assert [(r["step"], r["origin"]) for r in reporter.skips] == [
        (1, {"phase": "forward", "module": "net.0", "kind": "nan", "float32": "finite", "islands": ["net.0", "net.2"]})
    ]


def test_validation_calls_are_not_kept():
    kept = []

    class Probe(Callback):
        def on_validation_end(self, trainer, pl_module):
            kept.append(len(reporter.origins.current.calls) if reporter.origins.current else 0)

    class WithVal(TinyModel):
        def validation_step(self, batch, batch_idx):
            return self(batch[0]).sum()

        def val_dataloader(self):
            return make_loader(n=16)

    reporter = NaNSkipReporter()
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[reporter, Probe()],
        max_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=0,
    ).fit(WithVal())
    assert kept == [0, 0]


class _CompiledNested(TinyModel):
    """A compiled child holding a compiled grandchild whose Linear overflows float16 at step 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        self.enc = torch.compile(
            torch.nn.Sequential(torch.nn.Identity(), torch.compile(inner, backend="aot_eager")), backend="aot_eager"
        )

    def forward(self, x):
        if self.trainer.global_step == 2:
            x = x * 1e6
        return self.net(self.enc(x))


@pytest.mark.parametrize("stance", [True, False])
def test_a_compiled_child_is_replayed_eagerly_and_adds_no_graph(monkeypatch, stance):
    if not stance or not hasattr(torch.compiler, "set_stance"):  # torch < 2.6: the compiled forwards set aside
        monkeypatch.delattr(torch.compiler, "set_stance", raising=False)

    def run(find_origin):
        torch._dynamo.reset()
        before = dict(torch._dynamo.utils.counters["stats"])
        reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=4).fit(
            _CompiledNested()
        )
        after = torch._dynamo.utils.counters["stats"]
        return reporter, {k: after[k] - before.get(k, 0) for k in after}

    plain, plain_graphs = run(False)
    told, told_graphs = run("replay")  # watched from the start: the compiled child as a whole, from outside
    assert [(r["step"], r["origin"]) for r in told.skips] == [
        (2, {"phase": "forward", "module": "enc", "kind": "nan", "float32": "finite", "islands": ["enc"]})
    ]
    assert told_graphs == plain_graphs  # no hook traced into a graph, nothing recompiled


def test_a_second_trainer_does_not_inherit_an_origin_told_in_the_first():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=False)
    reporter._device_probe._told[2] = {"phase": "input"}  # left by a fit that failed before collecting it
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=4).fit(
        TinyModel(optimizer="fused_sgd", grad_poison={2: "net.0.weight"})
    )
    assert [(r["step"], r["origin"]) for r in reporter.skips] == [(2, None)]


def test_the_skip_line_word_for_word():
    from lightning_amp_plus.callbacks._skip_text import describe as _describe

    def line(offenders, origin=None, new_scale=512.0):
        return _describe({"step": 7, "offenders": offenders, "origin": origin, "scale": 1024.0, "new_scale": new_scale})

    def off(name, inf=0, nan=0):
        return {"name": name, "inf": inf, "nan": nan}

    assert line(None) == (
        "step 7 skipped: gradients non-finite (found by a fused optimizer; `NaNSkipReporter(sync_fused=True)` names"
        " them), loss scale 1024 -> 512"
    )
    assert line([], new_scale=None) == "step 7 skipped: gradients non-finite, loss scale 1024"
    three = [off("a", inf=2), off("b", nan=1), off("c", inf=1, nan=3)]
    assert line(three) == (
        "step 7 skipped: gradients non-finite in a (2 inf), b (1 nan), c (1 inf and 3 nan), loss scale 1024 -> 512"
    )
    assert line([*three, off("d", inf=1)]) == (  # the fourth is "1 more": three are named, never four
        "step 7 skipped: gradients non-finite in a (2 inf), b (1 nan), c (1 inf and 3 nan) and 1 more,"
        " loss scale 1024 -> 512"
    )
    assert line([*three, off("d", inf=1), off("e", nan=1)]) == (
        "step 7 skipped: gradients non-finite in a (2 inf), b (1 nan), c (1 inf and 3 nan) and 2 more,"
        " loss scale 1024 -> 512"
    )
    origins = {
        "step 7 skipped: born in forward of enc.3 (inf); gradients non-finite, loss scale 1024 -> 512": {
            "phase": "forward",
            "module": "enc.3",
            "kind": "inf",
        },
        "step 7 skipped: born in forward of the LightningModule's own code (between its module calls) (nan);"
        " gradients non-finite, loss scale 1024 -> 512": {"phase": "forward", "module": "", "kind": "nan"},
        "step 7 skipped: born in forward of enc (the module inside: unknown, nondeterministic: the replay of enc"
        " computed other values than the step); gradients non-finite, loss scale 1024 -> 512": {
            "phase": "forward",
            "module": None,
            "within": "enc",
            "kind": "nan",
            "reason": "nondeterministic: the replay of enc computed other values than the step",
        },
        "step 7 skipped: origin unknown (the replay of enc raised RuntimeError: boom); gradients non-finite, loss"
        " scale 1024 -> 512": {"phase": "unknown", "reason": "the replay of enc raised RuntimeError: boom"},
        "step 7 skipped: born in the batch (the inputs held inf/nan); gradients non-finite, loss scale 1024 -> 512": {
            "phase": "input"
        },
        "step 7 skipped: born in the loss (every watched module output was finite); gradients non-finite, loss"
        " scale 1024 -> 512": {"phase": "loss"},
        "step 7 skipped: born in backward (the loss was finite); gradients non-finite, loss scale 1024 -> 512": {
            "phase": "backward"
        },
        "step 7 skipped: gradients non-finite, loss scale 1024 -> 512": {"phase": "unheard-of"},
    }
    for expected, origin in origins.items():
        assert line([], origin) == expected
    assert line([], {}) == line([], None) == "step 7 skipped: gradients non-finite, loss scale 1024 -> 512"


class _BusyPeek:
    """`FlagPeek` on a device still busy with the step: no answer at the first look, the flag at the next (or when
    waited for). Every look is counted, so a test sees which look told it."""

    looks: list[tuple[int, bool]] = []
    busy_looks = 1

    def __init__(self, tensor):
        from lightning_amp_plus.syncs import FlagPeek

        self._real = FlagPeek(tensor)
        self._seen = 0

    def value(self, wait=False):
        self._seen += 1
        _BusyPeek.looks.append((self._seen, wait))
        if self._seen <= self.busy_looks and not wait:
            return None
        return self._real.value(wait=wait)


@pytest.mark.parametrize("last", [False, True])
def test_an_origin_decided_on_a_busy_device_is_told_at_the_next_look_or_at_the_end(monkeypatch, last):
    """Right after its step the device is still busy: the probe is kept, read when the next batch starts (no sync),
    or at the end of fit (where the history's flush waits anyway) when it was the last batch; the skip is reported
    with its origin either way."""
    from lightning_amp_plus.callbacks import _device_probe as nan_skip_reporter

    _BusyPeek.looks = []
    monkeypatch.setattr(nan_skip_reporter, "FlagPeek", _BusyPeek)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    poisoned = 3 if last else 1
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[reporter],
        max_steps=4,
        log_every_n_steps=1,  # the history moves to the host at every step: the skip is there before its origin
    ).fit(_BatchPoison({poisoned}, optimizer="fused_sgd"))
    assert [(r["step"], r["origin"]) for r in reporter.skips] == [(poisoned, {"phase": "input", "reason": WATCHING})]
    assert (2, last) in _BusyPeek.looks  # its second look told it: at the next batch's start, or waited for
    assert [look for look in _BusyPeek.looks if look[1]] == [(2, True)]  # one wait per fit: the last batch's flag


class _FailsAt(_BatchPoison):
    def __init__(self, at, fail_at, **kwargs):
        super().__init__(at, **kwargs)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError(f"user error at batch {batch_idx}")
        return super().training_step(batch, batch_idx)


def test_a_skip_held_for_its_origin_is_reported_when_the_fit_fails(monkeypatch):
    from lightning_amp_plus.callbacks import _device_probe as nan_skip_reporter

    _BusyPeek.looks = []
    monkeypatch.setattr(nan_skip_reporter, "FlagPeek", _BusyPeek)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[reporter],
        max_steps=6,
        log_every_n_steps=1,
    )
    with pytest.raises(RuntimeError, match="^user error at batch 2$"):
        trainer.fit(_FailsAt({1}, fail_at=2, optimizer="fused_sgd"))
    assert [(r["step"], r["origin"]) for r in reporter.skips] == [(1, {"phase": "input", "reason": WATCHING})]


@pytest.mark.parametrize("advisor_first", [True, False])
def test_the_collapse_is_raised_whoever_collects_the_last_skips(monkeypatch, advisor_first):
    """On a busy device the last skips are collected at the end of fit, by AmpAdvisor if it runs first: the reporter
    still checks them for a collapse."""
    from lightning_amp_plus import AmpAdvisor
    from lightning_amp_plus.callbacks import _device_probe as nan_skip_reporter

    _BusyPeek.looks = []
    monkeypatch.setattr(nan_skip_reporter, "FlagPeek", _BusyPeek)
    reporter = NaNSkipReporter(max_consecutive_skips=2, max_warnings=0)
    advisor = AmpAdvisor(print_advice=False)
    callbacks = [advisor, reporter] if advisor_first else [reporter, advisor]
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=callbacks, max_steps=6, log_every_n_steps=1
    )
    with pytest.raises(LossScaleCollapseError, match="2 consecutive optimizer steps were skipped"):
        trainer.fit(_BatchPoison({4, 5}, optimizer="fused_sgd"))
    assert reporter.skipped_steps == [4, 5]


def test_the_advisor_waits_for_the_last_batchs_origin_on_a_busy_device(monkeypatch):
    from lightning_amp_plus import AmpAdvisor
    from lightning_amp_plus.callbacks import _device_probe as nan_skip_reporter

    _BusyPeek.looks = []
    monkeypatch.setattr(_BusyPeek, "busy_looks", 5)  # still busy whenever looked at without waiting
    monkeypatch.setattr(nan_skip_reporter, "FlagPeek", _BusyPeek)
    advisor = AmpAdvisor(print_advice=False)  # runs its own reporter: it must read the held probe itself
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[advisor], max_steps=4).fit(
        _BatchPoison({3}, optimizer="fused_sgd")
    )
    assert advisor.figures.origins == [{"phase": "input", "reason": WATCHING, "step": 3}]


class _Deep(TinyModel):
    """Three linear layers: six parameters, enough to rank more worst offenders than the summary names."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


@pytest.mark.parametrize("skips", [20, 21])
def test_the_summary_names_twenty_steps_and_five_offenders_by_count(tmp_path, caplog, skips):
    """Every other update poisons one parameter's gradient; parameter k is poisoned 6 - k times (21 in all): the
    summary lists the first 20 skipped steps (then "...", only when there are more) and the 5 most frequent offenders,
    most frequent first; the JSON report says what a step is."""
    names = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.2.weight", "net.2.bias"]
    order = [name for k, name in enumerate(names) for _ in range(6 - k)][:skips]
    poison = {2 * i: name for i, name in enumerate(order)}
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**16, min_scale=2.0**-16)
    reporter = NaNSkipReporter(max_warnings=0, report_path=tmp_path / "skips.json")
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=2 * skips).fit(_Deep(grad_poison=poison))
    (summary,) = [r.getMessage() for r in caplog.records if r.name == "lightning_amp_plus"]
    steps = ", ".join(str(2 * i) for i in range(20)) + (", ..." if skips > 20 else "")
    counts = {name: order.count(name) for name in names}
    worst = ", ".join(f"{n} ({counts[n]} skip{'s' if counts[n] > 1 else ''})" for n in names[:5])
    assert summary == (
        f"`NaNSkipReporter`: {skips} of {2 * skips} updates skipped (at step {steps}); worst offenders: {worst}."
    )
    report = json.loads((tmp_path / "skips.json").read_text())
    assert report["worst_offenders"] == [{"name": n, "skips": counts[n]} for n in names if counts[n]]
    assert report["unit"].startswith("update: one loss-scale cycle")
    assert report["unit"].endswith("steps are the logger's step")


def test_a_fused_optimizers_skip_is_told_with_its_offenders_and_on_time(caplog, tmp_path):
    """Its flag is read at the batch's end (at once on CPU): the skip's line comes then, as a plain optimizer's does
    (not at the next logging step), with the offenders its gradients still held, also when another callback flushed
    the history first."""
    from lightning.pytorch import Callback

    from lightning_amp_plus import LossScaleMonitor

    ends = []

    class Ends(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(len([r for r in caplog.records if r.getMessage().startswith("step 2 skipped")]))

    model = TinyModel(poison={2: "inf"}, optimizer="fused_adamw", lr=1e-3)
    reporter = NaNSkipReporter()
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[LossScaleMonitor(), reporter, Ends()],  # the monitor flushes the history at each logging step
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        max_steps=6,
    ).fit(model)
    assert ends == [0, 0, 1, 1, 1, 1]  # told at step 2's end, not at the logging step after it nor the fit's end
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_amp_plus"]
    assert lines[0].startswith(
        "step 2 skipped: born in forward or in the loss (the loss was inf; no module named yet: every module is"
        " watched from the next step); gradients non-finite in net.0.weight ("
    )
    assert lines[-1].startswith("`NaNSkipReporter`: 1 of 6 updates skipped (at step 2); worst offenders: net.0.weight")


class _Temperature(TinyModel):
    """The optimizer also trains a tensor that is no parameter of the module; step 1 poisons its gradient."""

    def __init__(self):
        super().__init__()
        self.extra = [torch.nn.Parameter(torch.ones(3))]  # a list: the module does not register it

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        scale = self.extra[0]
        if self.trainer.global_step == 1:
            scale = scale * torch.tensor([1.0, float("inf"), 1.0])
        return loss * scale.sum() / 3

    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), *self.extra], lr=0.01)


def test_an_offender_the_module_does_not_name_is_told_by_its_shape():
    reporter = NaNSkipReporter(max_warnings=0)
    model = _Temperature()
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=3).fit(
        model
    )
    (record,) = reporter.skips
    assert "<unnamed (3,)>" in [o["name"] for o in record["offenders"]]


def test_sharded_offenders_and_loss_are_summed_and_averaged_over_the_ranks(monkeypatch):
    """Sharded gradients: the other rank (a fake peer) saw one inf and one nan in every parameter and a loss of 7;
    the record sums the counts (a parameter without a gradient on this rank is named for the other's) and averages
    the loss."""
    from lightning_amp_plus.callbacks import nan_skip_reporter
    from tests.helpers.sharded import FakePeer

    def other_rank(tensor, op):
        return torch.ones_like(tensor) if tensor.dtype == torch.int64 else torch.full_like(tensor, 7.0)

    class _Unused(TinyModel):
        def __init__(self):
            super().__init__(grad_poison={1: "net.2.bias"})
            self.unused = torch.nn.Parameter(torch.ones(2))

    reporter = NaNSkipReporter(max_warnings=0)
    model = _Unused()
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=3)
    peer = FakePeer(monkeypatch, other_rank)
    monkeypatch.setattr(nan_skip_reporter, "shards_gradients", lambda trainer: True)
    trainer.fit(model)
    (record,) = reporter.skips
    assert record["offenders"] == [
        {"name": "unused", "inf": 1, "nan": 1},  # no gradient here (the module's own parameter, listed first)
        {"name": "net.0.weight", "inf": 1, "nan": 1},
        {"name": "net.0.bias", "inf": 1, "nan": 1},
        {"name": "net.2.weight", "inf": 1, "nan": 1},
        {"name": "net.2.bias", "inf": 2, "nan": 1},  # its one element inf here
    ]
    assert record["loss"] == pytest.approx((model.losses[1] + 7.0) / 2)
    assert {c["theirs"].dtype for c in peer.calls} == {torch.int64, torch.float32}


class _Alternating(TinyModel):
    """Manual optimization as Lightning's GAN example writes it (``step()`` then ``zero_grad()``): a fused optimizer
    steps on even batches, a plain one on odd batches; the losses of batches 2 and 3 are inf."""

    poisoned = (2, 3)

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        fused, plain = self.optimizers()
        x, y = batch
        opt, net = (fused, self.net) if batch_idx % 2 == 0 else (plain, self.other)
        loss = torch.nn.functional.mse_loss(net(x).float(), y) * (float("inf") if batch_idx in self.poisoned else 1.0)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()  # the gradients are gone before the update closes

    def configure_optimizers(self):
        fused = torch.optim.AdamW(self.net.parameters(), lr=1e-3, fused=True)
        return fused, torch.optim.SGD(self.other.parameters(), lr=0.01)


@pytest.mark.parametrize("sync_fused", [False, True])
def test_offenders_are_counted_when_the_step_is_skipped_before_the_gradients_are_zeroed(sync_fused):
    """The plain optimizer's skip is known at its step: its offenders are named though ``zero_grad()`` ran before
    the update closed; the fused optimizer's skip of the batch before is reported first (without names unless
    ``sync_fused``)."""
    reporter = NaNSkipReporter(max_warnings=0, sync_fused=sync_fused)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=6).fit(
        _Alternating()
    )
    fused = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"] if sync_fused else None
    named = [(r["step"], r["offenders"] and [o["name"] for o in r["offenders"]]) for r in reporter.skips]
    assert named == [(2, fused), (3, ["other.weight", "other.bias"])]


class _BothInOneBatch(_Alternating):
    """Both optimizers step in every batch (``zero_grad()`` first, as in the README); batch 1's losses are inf."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt, net in zip(self.optimizers(), (self.net, self.other), strict=True):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x).float(), y) * (float("inf") if batch_idx == 1 else 1.0)
            self.manual_backward(loss)
            opt.step()


def test_a_fused_optimizers_offenders_are_counted_at_the_close_when_its_skip_was_not_known_at_its_step():
    reporter = NaNSkipReporter(max_warnings=0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=6).fit(
        _BothInOneBatch()
    )
    (record,) = reporter.skips
    assert [o["name"] for o in record["offenders"]] == [
        "net.0.weight",  # the fused optimizer's, read when the update closed (the plain one's skip told the host)
        "net.0.bias",
        "net.2.weight",
        "net.2.bias",
        "other.weight",  # the plain optimizer's, counted at its step
        "other.bias",
    ]


class _MaskMaker(torch.nn.Module):
    """Makes an attention-style mask: its output holds -inf by design."""

    def forward(self, x):
        mask = torch.zeros(x.shape[-1], device=x.device)
        mask[-1] = float("-inf")
        return mask


class _Overflowing(torch.nn.Module):
    """Attends with a mask; at ``overflow_at`` its float16 product overflows to +inf."""

    overflow_at = -1

    def forward(self, x, mask):
        out = x * torch.softmax(x + mask, dim=-1)
        return (out.half() * 7e4).float() / 7e4 if self.calls == self.overflow_at else out

    calls = 0


class _MaskedModel(TinyModel):
    def __init__(self, overflow_at=-1, **kwargs):
        super().__init__(**kwargs)
        self.maker, self.attend = _MaskMaker(), _Overflowing()
        self.attend.overflow_at = overflow_at

    def forward(self, x):
        return self.net(self.attend(x, self.maker(x)))

    def on_train_batch_start(self, batch, batch_idx):
        self.attend.calls = batch_idx


def test_a_module_whose_output_is_a_minus_inf_mask_is_no_origin_and_one_fed_a_mask_can_be():
    """-inf alone is a mask in a module's output and in its inputs: the mask maker is never the origin, and a module
    fed the mask whose own output overflows is."""
    assert _origins(_MaskedModel(grad_poison={2: "net.0.weight"}), max_steps=4) == [(2, {"phase": "backward"})]
    assert _origins(_MaskedModel(overflow_at=1), "replay", max_steps=3) == [
        (1, {"phase": "forward", "module": "attend", "kind": "inf", "float32": "nonfinite"})  # it casts to half itself
    ]


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_the_collapse_names_five_offenders(optimizer):
    """A nan loss makes all six parameters offenders: the collapse names the first five (a fused optimizer's too)."""
    names = "net.0.weight, net.0.bias, net.1.weight, net.1.bias, net.2.weight"
    reporter = NaNSkipReporter(max_consecutive_skips=2, max_warnings=0)
    with pytest.raises(LossScaleCollapseError, match=rf"; last offenders: {re.escape(names)}\. The loss was inf/nan"):
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter]).fit(
            _Deep(poison={s: "nan" for s in range(1, 10)}, optimizer=optimizer, lr=1e-3)  # fused: step 0 is read
        )


def test_only_rank_zero_writes_the_report(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    monkeypatch.setattr(Trainer, "is_global_zero", property(lambda self: False))
    reporter = NaNSkipReporter(max_warnings=0, report_path=tmp_path / "skips.json")
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=3).fit(
        TinyModel(poison={1: "inf"})
    )
    assert [r["step"] for r in reporter.skips] == [1]  # recorded on every rank
    assert not (tmp_path / "skips.json").exists()


class _OnlyExtra(_Temperature):
    """The module's own parameters take no part in the loss: on this rank none has a gradient."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        scale = self.extra[0] * (float("inf") if self.trainer.global_step == 1 else 1.0)
        return (x.sum() * scale).sum() * 1e-3


def test_a_rank_without_any_gradient_of_the_module_still_joins_the_offender_sum(monkeypatch):
    """Sharded: this rank holds no gradient of any module parameter, yet it joins the reduction (or the other ranks
    would wait for it), and the record names what the other rank counted."""
    from lightning_amp_plus.callbacks import nan_skip_reporter
    from tests.helpers.sharded import FakePeer

    def other_rank(tensor, op):
        return torch.ones_like(tensor) if tensor.dtype == torch.int64 else tensor.clone()

    reporter = NaNSkipReporter(max_warnings=0, find_origin=False)
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=3)
    peer = FakePeer(monkeypatch, other_rank)
    monkeypatch.setattr(nan_skip_reporter, "shards_gradients", lambda trainer: True)
    trainer.fit(_OnlyExtra())
    (record,) = reporter.skips
    assert record["offenders"] == [
        {"name": name, "inf": 1, "nan": 1} for name in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
    ]
    assert [c["theirs"].dtype for c in peer.calls].count(torch.int64) == 1


class _PlainThenFused(_Alternating):
    """As ``_Alternating``, with the plain optimizer's batch 1 and the fused optimizer's batch 2 overflowing."""

    poisoned = (1, 2)


def test_a_device_skip_after_a_host_known_one_is_collected_past_it():
    reporter = NaNSkipReporter(max_warnings=0, max_consecutive_skips=None)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=8).fit(
        _PlainThenFused()
    )
    assert [(r["step"], r["offenders"] is None) for r in reporter.skips] == [(1, False), (2, True)]


def test_an_odd_max_records_keeps_the_smaller_half_first_and_the_larger_last():
    reporter = NaNSkipReporter(max_warnings=0, max_consecutive_skips=None, max_records=3)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**16)], callbacks=[reporter], max_steps=10).fit(
        TinyModel(poison={s: "inf" for s in (1, 3, 5, 7, 9)})
    )
    assert [r["step"] for r in reporter.skips] == [1, 7, 9]
    assert reporter.report()["records_dropped"] == 2


def test_a_fused_optimizers_collapse_stops_the_fit_at_the_logging_point_that_finds_it():
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[reporter],
        max_steps=40,
        log_every_n_steps=4,
    )
    with pytest.raises(LossScaleCollapseError, match=r"3 consecutive optimizer steps were skipped"):
        trainer.fit(TinyModel(poison={s: "inf" for s in range(1, 40)}, optimizer="fused_adamw", lr=1e-3))
    assert trainer.global_step <= 8  # found at the logging point after the third skip, not at the end of fit


def test_min_scale_zero_collapses_at_the_scalers_real_floor():
    # min_scale=0: the scaler stops at float32's smallest normal (2**-126), and that is the floor the collapse reads
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**-124, min_scale=0.0)
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    with pytest.raises(LossScaleCollapseError, match=r"overflowed while the loss scale already sat at min_scale=0"):
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=10).fit(
            TinyModel(poison={s: "nan" for s in range(10)})
        )
    assert plugin.history.num_steps == 3  # 2**-124, 2**-125, then 2**-126: the floor


@pytest.mark.parametrize("make", [NaNSkipReporter, lambda: __import__("lightning_amp_plus").LossScaleMonitor()])
def test_every_declared_field_is_the_attribute_the_callback_uses_and_reset_renews_it(make):
    """A field declared under one name and used under another would never be reset or saved."""
    callback = make()
    before = {name: getattr(callback, f"_{name}") for name in callback._fields}  # each exists after __init__
    callback.reset()
    for name, value in before.items():
        after = getattr(callback, f"_{name}")
        assert after == value or type(after) is type(value), name
        if isinstance(value, (list, dict, set)) or hasattr(value, "__dict__"):
            assert after is not value, name  # a fresh container per fit, never the last fit's


def test_a_checkpoint_without_a_newer_field_loads_that_field_at_its_default():
    """An older version's checkpoint lacks the fields added since: they start at their defaults, the rest loads."""
    from lightning_amp_plus import LossScaleMonitor

    monitor = LossScaleMonitor()
    monitor._growths, monitor._steps_logged = 3, 9
    state = monitor.state_dict()
    del state["steps_logged"]
    fresh = LossScaleMonitor()
    fresh._steps_logged = 5  # what a previous fit left
    fresh.load_state_dict(state)
    assert (fresh._growths, fresh._steps_logged) == (3, 0)


def test_an_offender_counter_names_what_it_was_not_told_about_and_keeps_a_skipped_steps_count():
    from lightning_amp_plus.callbacks._offenders import OffenderCounter

    counter = OffenderCounter()  # not tracking any module yet: a parameter is named by its shape
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.tensor([float("inf"), float("nan")])
    assert counter.of([opt]) == [{"name": "<unnamed (2,)>", "inf": 1, "nan": 1}]
    counter.at_skipped_step(opt)
    param.grad = torch.zeros(2)  # zeroed before the update closed (a GAN's step)
    assert counter.of([opt]) == [{"name": "<unnamed (2,)>", "inf": 1, "nan": 1}]  # as counted at the skip
    counter.clear()
    assert counter.of([opt]) == []


def test_a_held_scale_says_why(caplog):
    model = TinyModel(grad_poison={2: "net.0.weight", 3: "net.0.weight"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, hysteresis=2)
    make_trainer(plugins=[plugin], callbacks=[NaNSkipReporter()], max_steps=5).fit(model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].endswith(
        "loss scale 1024 -> 1024 (kept: with hysteresis=2, the scale backs off at the 2nd overflow since it last grew)"
    )
    assert lines[1].endswith("loss scale 1024 -> 512")  # the second backs off: no reason to give
    floor = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    caplog.clear()
    with pytest.raises(LossScaleCollapseError):  # an overflow at min_scale stops the fit, after its line
        make_trainer(plugins=[floor], callbacks=[reporter], max_steps=3).fit(TinyModel(grad_poison={1: "net.0.weight"}))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert line.endswith("loss scale 1 -> 1 (held at min_scale=1)")


@pytest.mark.parametrize("optimizer", ["sgd", "fused_sgd"])
def test_a_skip_on_the_last_step_before_a_log_says_what_it_did_to_the_scale(caplog, optimizer):
    """A fused optimizer's skip is read at the logging step: its line still ends with the new scale and why."""
    model = TinyModel(optimizer=optimizer, grad_poison={3: "net.0.weight"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, hysteresis=2, growth_interval=100)
    make_trainer(plugins=[plugin], callbacks=[NaNSkipReporter()], max_steps=6, log_every_n_steps=4).fit(model)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert line.startswith("step 3 skipped: ")
    assert line.endswith(
        "loss scale 1024 -> 1024 (kept: with hysteresis=2, the scale backs off at the 2nd overflow since it last grew)"
    )


def test_a_scale_is_shown_in_full():
    from lightning_amp_plus._repr import number

    assert number(2.0**22) == "4194304"  # as the docs show scales, not 4.1943e+06
    assert number(0.5) == "0.5"
    assert number(2.0**50) == "1125899906842624"
    assert float(number(2.0**-20)) == 2.0**-20
    assert number(float("inf")) == "inf"


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize(("optimizer", "raised_at"), [("fused_adamw", 9), ("sgd", 8)])
def test_a_collapse_is_raised_at_the_same_step_with_checkpoints_and_the_checkpoint_before_it_is_written(
    tmp_path, optimizer, raised_at, checkpoint
):
    """Three overflows in a row at steps 6, 7, 8. A fused optimizer's are found as their flags are read, at each
    batch's end on CPU (not at the logging steps 7, 11): the third at step 8's end, after Lightning counted the step
    (a plain optimizer's raises inside it). No checkpoint is written from the collapsed state either way."""
    reporter = NaNSkipReporter(max_consecutive_skips=3, max_warnings=0)
    callbacks = [reporter]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1))
    trainer = make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=callbacks,
        max_steps=15,
        log_every_n_steps=4,
        enable_checkpointing=checkpoint,
    )
    with pytest.raises(LossScaleCollapseError, match=r"3 consecutive optimizer steps were skipped"):
        trainer.fit(TinyModel(poison={6: "inf", 7: "inf", 8: "inf"}, optimizer=optimizer, lr=1e-3))
    assert trainer.global_step == raised_at
    assert reporter.skipped_steps == [6, 7, 8]
    if checkpoint:  # every checkpoint before the collapse, none from the collapsed state
        saved = [f"epoch=0-step={s}.ckpt" for s in range(3, raised_at, 3)]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(saved)


class _OneInfGradient(TinyModel):
    """One element of ``net.0.weight``'s gradient overflows to inf at step 2, under gradient clipping."""

    def __init__(self, optimizer):
        super().__init__(optimizer=optimizer)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:

            def one_inf(grad):
                grad = grad.clone()
                grad[0, 0] = float("inf")
                return grad

            self._handles.append(self.net[0].weight.register_hook(one_inf))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_an_overflow_is_told_inf_under_gradient_clipping_not_the_nan_clipping_would_make(
    precision, optimizer, algorithm
):
    """Break pass: clipping by an infinite norm multiplies the gradients by 0 (inf * 0 = nan), so the skip line said
    `(1 nan)` for an element that overflowed to inf; clipping by value made it finite, and no parameter was named. A
    step the host knows is skipped (a plain optimizer's flag, read by its step anyway) is not clipped: the reporter
    reads the true gradients. A fused optimizer decides on the device: clipped as before (the limits page)."""
    model = _OneInfGradient(optimizer)
    reporter = NaNSkipReporter(max_warnings=0)
    knobs = {"init_scale": 1024.0} if precision == "16-mixed" else {}
    trainer = make_trainer(
        plugins=[AmpPlusPrecision(precision, **knobs)],
        callbacks=[reporter],
        max_steps=4,
        gradient_clip_val=0.5,
        gradient_clip_algorithm=algorithm,
    )
    trainer.fit(model)
    assert [r["step"] for r in reporter.skips] == [2]
    assert reporter.skips[0]["offenders"] == [{"name": "net.0.weight", "inf": 1, "nan": 0}]
