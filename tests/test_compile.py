"""torch.compile: a compiled model or submodule trains under the plugin with every callback, as the eager one."""

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import (
    AmpPlusPrecision,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer


class CompiledSubmodule(TinyModel):
    def __init__(self, compile_net: bool, **kwargs):
        super().__init__(**kwargs)
        if compile_net:
            self.net = torch.compile(self.net, backend="aot_eager")


def _fit(tmp_path, name, model, fp32_modules=None):
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=fp32_modules)
    reporter = NaNSkipReporter(max_warnings=0)
    report = PrecisionReport(print_table=False)
    underflow = GradUnderflowMonitor(every_n_steps=2)
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=2), reporter, report, underflow],
        logger=CSVLogger(tmp_path, name=name),
        max_steps=6,
        gradient_clip_val=1.0,
    ).fit(model)
    return plugin, reporter, report, underflow


@pytest.mark.parametrize("how", ["submodule", "whole"])
def test_a_compiled_model_trains_as_the_eager_one_with_every_callback(tmp_path, how):
    torch.manual_seed(0)
    eager = CompiledSubmodule(False, grad_poison={3: "net.2.bias"})
    torch.manual_seed(0)
    poisoned = "net._orig_mod.2.bias" if how == "submodule" else "net.2.bias"  # the attribute path as registered
    inner = CompiledSubmodule(how == "submodule", grad_poison={3: poisoned})
    compiled = inner if how == "submodule" else torch.compile(inner, backend="aot_eager")
    e_plugin, e_reporter, e_report, e_underflow = _fit(tmp_path, "eager", eager)
    c_plugin, c_reporter, c_report, c_underflow = _fit(tmp_path, "compiled", compiled)
    assert c_plugin.history.curve() == e_plugin.history.curve()
    assert c_plugin.history.skipped_steps == e_plugin.history.skipped_steps == [3]
    assert [o["name"] for o in c_reporter.skips[0]["offenders"]] == ["net.2.bias"]  # no `_orig_mod.` in names
    assert [m["step"] for m in c_underflow.measurements] == [m["step"] for m in e_underflow.measurements]
    for (name, a), (_, b) in zip(eager.named_parameters(), inner.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
    assert [r["name"] for r in e_report.rows] == ["net.0", "net.1", "net.2"]
    if how == "submodule":  # one row, read from outside its graph (no replay by default)
        assert [(r["name"], r["compiled"]) for r in c_report.rows] == [("net", True)]
        assert c_report.rows[0]["output_dtype"] == e_report.rows[-1]["output_dtype"]
        assert not any(r["compiled"] for r in e_report.rows)
    else:  # compiled as a whole: hooks would sit inside the graph; nothing inspected, and the report says so
        assert c_report.rows == []
        assert "compiled as a whole" in c_report.skipped_reason
        assert "compiled as a whole" in c_report.format_table()


@pytest.mark.parametrize("entry", ["net.2", "net._orig_mod.2", torch.nn.Linear])
def test_fp32_islands_match_names_with_or_without_the_compile_prefix(tmp_path, entry):
    model = CompiledSubmodule(True)
    plugin = AmpPlusPrecision("16-mixed", fp32_modules=[entry])
    make_trainer(plugins=[plugin], max_steps=1).fit(model)
    assert plugin.fp32_module_names == []  # removed at teardown
    plugin2 = AmpPlusPrecision("16-mixed", fp32_modules=[entry])
    names = plugin2._islands.match(model)
    assert names == (["net._orig_mod.0", "net._orig_mod.2"] if isinstance(entry, type) else ["net._orig_mod.2"])
    assert not any(n == "net" for n in names)  # the compile wrapper itself is never an island


def test_island_names_never_carry_the_compile_prefix():
    model = CompiledSubmodule(True)
    seen = {}

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["names"] = trainer.precision_plugin.fp32_module_names

    plugin = AmpPlusPrecision("16-mixed", fp32_modules=[torch.nn.Linear])
    make_trainer(plugins=[plugin], callbacks=[Probe()], max_steps=1).fit(model)
    assert seen["names"] == ["net.0", "net.2"]  # as the user wrote them, like every other name the package reports


class Regularised(LightningModule):
    """A compiled submodule with dropout and batch norm: random state and running statistics both matter."""

    def __init__(self, backend):
        super().__init__()
        torch.manual_seed(0)
        body = torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.GELU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(32, 1),
        )
        self.body = torch.compile(body, backend=backend)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return make_loader(n=48, batch_size=8)


def _graphs():
    return sum(torch._dynamo.utils.counters["stats"].values())


def _fit_regularised(backend, report):
    torch._dynamo.reset()
    before = dict(torch._dynamo.utils.counters["stats"])
    model = Regularised(backend)
    torch.manual_seed(1)
    callbacks = [report] if report is not None else []
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=256.0)], callbacks=callbacks, max_steps=6).fit(model)
    after = torch._dynamo.utils.counters["stats"]
    compiles = {k: after[k] - before.get(k, 0) for k in after}
    return model, compiles


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_report_leaves_a_compiled_models_training_unchanged(backend, replay):
    plain, plain_compiles = _fit_regularised(backend, None)
    report = PrecisionReport(print_table=False, replay_compiled=replay)
    inspected, inspected_compiles = _fit_regularised(backend, report)
    # bit for bit: the same losses, weights and running statistics, and the same graphs compiled (no graph break,
    # no recompilation from hooks inside the compiled region)
    assert [float(x) for x in inspected.losses] == [float(x) for x in plain.losses]
    for (name, a), (_, b) in zip(plain.state_dict().items(), inspected.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert inspected_compiles == plain_compiles
    rows = {r["name"]: r for r in report.rows}
    assert all(r["compiled"] for r in report.rows)
    assert sum(r["time_share"] for r in report.rows) == pytest.approx(1.0)
    if not replay:  # by default one row, from outside the graph: nothing of yours ran twice
        assert list(rows) == ["body"]
        assert rows["body"]["output_dtype"] == "float16"
        return
    assert list(rows) == ["body.0", "body.1", "body.2", "body.3", "body.4"]
    assert rows["body.0"]["output_dtype"] == "float16"  # what autocast produced in the replayed call
    assert rows["body.0"]["autocast"]


class LoggingCompiledSubmodule(CompiledSubmodule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)  # Lightning's logging stays outside the compiled graph
        return loss


def test_a_compiled_submodule_with_self_log_trains_and_logs(tmp_path):
    from tests.callbacks.test_loss_scale_monitor import read_csv

    model = LoggingCompiledSubmodule(True, poison={2: "inf"})
    logger = CSVLogger(tmp_path, name="run")
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    make_trainer(
        plugins=[plugin],
        callbacks=[LossScaleMonitor(logging_interval=1)],
        logger=logger,
        max_steps=4,
        log_every_n_steps=1,
    ).fit(model)
    rows = read_csv(logger.experiment.metrics_file_path)
    losses = {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}
    assert sorted(losses) == [0, 1, 2, 3]
    assert losses[2] == float("inf")  # the poisoned step, logged as it was
    assert plugin.history.skipped_steps == [2]


class Tricky(LightningModule):
    """Compiled submodules the replay must not disturb: nested, aliased, mutating their input, calling autograd."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "nested":
            inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
            self.enc = torch.compile(
                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.compile(inner, backend="aot_eager")),
                backend="aot_eager",
            )
        elif kind == "alias":
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
            self.fast = torch.compile(self.body, backend="aot_eager")
        elif kind == "inplace":
            self.enc = torch.compile(_Doubling(), backend="aot_eager")
        else:
            self.enc = torch.compile(_WithGrad(), backend="aot_eager")
        self.head = torch.nn.Linear(8, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "alias":
            h = self.fast(x)
        elif self.kind == "grad":
            h = self.enc(x.requires_grad_(True))
        else:
            h = self.enc(x)
            h = h + x  # reuses an input the compiled call may have changed in place
        loss = torch.nn.functional.mse_loss(self.head(h).float(), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return make_loader(n=32, batch_size=8)


class _Doubling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


class _WithGrad(torch.nn.Module):
    """A physics-informed style forward: the output's gradient with respect to the input."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        u = self.lin(x)
        (du,) = torch.autograd.grad(u.sum(), x, retain_graph=True)
        return u + du


@pytest.mark.parametrize("stance", [True, False])
@pytest.mark.parametrize("kind", ["nested", "alias", "inplace", "grad"])
def test_the_opt_in_replay_leaves_tricky_compiled_submodules_unchanged(kind, stance, monkeypatch):
    if not stance:  # torch < 2.6 has no set_stance: the compiled forwards are set aside instead
        monkeypatch.delattr(torch.compiler, "set_stance", raising=False)

    def fit(report):
        torch._dynamo.reset()
        before = dict(torch._dynamo.utils.counters["stats"])
        model = Tricky(kind)
        torch.manual_seed(1)
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=256.0)],
            callbacks=[report] if report else [],
            max_steps=3,
        ).fit(model)
        after = torch._dynamo.utils.counters["stats"]
        return model, {k: after[k] - before.get(k, 0) for k in after}

    plain, plain_compiles = fit(None)
    outside = PrecisionReport(print_table=False, every_n_batches=1)
    fit(outside)
    compiled = {"alias": "fast"}.get(kind, "enc")
    assert [(r["name"], r["compiled"]) for r in outside.rows] == [(compiled, True), ("head", False)]
    report = PrecisionReport(print_table=False, every_n_batches=1, replay_compiled=True)
    inspected, inspected_compiles = fit(report)
    assert inspected.losses == plain.losses
    for (name, a), (_, b) in zip(plain.state_dict().items(), inspected.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert inspected_compiles == plain_compiles  # no hook traced into a graph, nothing recompiled
    assert report.skipped_reason is None
    assert report.rows
    assert all(r["compiled"] for r in report.rows if r["name"] != "head")
    expected = {"nested": {"enc.0", "enc.1.0", "enc.1.1"}, "alias": {"fast.0", "fast.1"}}.get(kind, {"enc.lin"})
    assert {r["name"] for r in report.rows if r["compiled"]} == expected
    assert [r["name"] for r in report.rows if not r["compiled"]] == ["head"]


def test_the_whole_model_message_is_printed_once(caplog):
    caplog.set_level("WARNING", logger="lightning_amp_plus")
    report = PrecisionReport()
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[report], max_steps=4).fit(
        torch.compile(TinyModel(), backend="aot_eager")
    )
    lines = [r.getMessage() for r in caplog.records if "compiled as a whole" in r.getMessage()]
    assert len(lines) == 1


def test_a_glob_island_selects_the_same_modules_with_or_without_compile():
    eager = CompiledSubmodule(False)
    compiled = CompiledSubmodule(True)
    assert AmpPlusPrecision("16-mixed", fp32_modules=["net.*"])._islands.match(eager) == ["net.0", "net.1", "net.2"]
    names = AmpPlusPrecision("16-mixed", fp32_modules=["net.*"])._islands.match(compiled)
    assert names == ["net._orig_mod.0", "net._orig_mod.1", "net._orig_mod.2"]  # never `net` itself


class _Gate(torch.nn.Module):
    """A leaf whose keyword decides its precision: `fp32=True` runs it with autocast off."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, fp32=False):
        if fp32:
            with torch.autocast("cpu", enabled=False):
                return self.lin(x.float())
        return self.lin(x)


class _CompiledParts(TinyModel):
    def __init__(self):
        super().__init__()
        self.gate = torch.compile(_Gate(), backend="aot_eager")  # called with a keyword
        self.leaf = torch.compile(torch.nn.Linear(8, 8), backend="aot_eager")  # a compiled leaf module

    def forward(self, x):
        return self.net(self.leaf(self.gate(x, fp32=True)))


def test_the_reports_replay_passes_keywords_and_names_a_compiled_leaf_as_the_user_did():
    report = PrecisionReport(print_table=False, replay_compiled=True)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[report], max_steps=1).fit(_CompiledParts())
    rows = {r["name"]: r for r in report.rows}
    assert sorted(rows) == ["gate.lin", "leaf", "net.0", "net.1", "net.2"]
    assert rows["gate.lin"]["output_dtype"] == "float32"  # replayed with fp32=True, as it was called
    assert rows["gate.lin"]["compiled"]
    assert rows["leaf"]["output_dtype"] == "float16"
    assert rows["leaf"]["compiled"]
