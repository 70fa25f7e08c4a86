import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, PrecisionReport
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class Mixed(TinyModel):
    """net.0 Linear, net.1 ReLU, net.2 Linear; ``head`` runs with autocast disabled in user code."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        h = self.net(x)
        with torch.autocast(self.device.type, enabled=False):
            return self.head(h.float())


def test_report_dtypes_with_one_island():
    model = Mixed()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["net.2"])
    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[plugin], callbacks=[report], max_steps=3).fit(model)
    rows = {r["name"]: r for r in report.rows}
    assert list(rows) == ["net.0", "net.1", "net.2", "head"]  # forward order
    assert rows["net.0"]["output_dtype"] == "float16"
    assert not rows["net.0"]["flagged"]
    # the island casts the float16 it receives from net.1: it runs on float32 with autocast off, float32 out
    assert rows["net.2"]["input_dtype"] == "float32"
    assert rows["net.2"]["autocast"] is False
    assert rows["net.0"]["autocast"] is True
    assert rows["net.2"]["output_dtype"] == "float32"
    assert not rows["net.2"]["flagged"]  # an island is the user's choice: no heavy work left in float32
    assert (rows["net.2"]["island"], rows["net.2"]["cause"]) == ("net.2", None)
    assert rows["head"]["flagged"]
    assert "autocast disabled" in rows["head"]["cause"]
    assert rows["net.0"]["param_dtype"] == "float32"
    assert rows["net.1"]["param_dtype"] == "-"
    assert sum(r["time_share"] for r in report.rows) == pytest.approx(1.0)
    # hooks are gone after the inspected batch
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_bf16_dtypes_and_table(caplog):
    model = TinyModel()
    report = PrecisionReport()
    make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[report], max_steps=2).fit(model)
    assert [r["output_dtype"] for r in report.rows] == ["bfloat16", "bfloat16", "bfloat16"]
    assert not any(r["flagged"] for r in report.rows)
    table = report.format_table()
    (logged,) = [r.getMessage() for r in caplog.records if r.name == "lightning_amp_plus"]  # one logging record
    assert logged.startswith("PrecisionReport (first inspected batch)\n")
    assert logged.splitlines()[1:] == table.splitlines()[1:]
    assert "net.0" in table
    assert "Linear" in table
    assert "bfloat16" in table


def test_every_n_batches_inspects_again():
    inspected = []

    class Counting(PrecisionReport):
        def _install(self, pl_module):
            inspected.append(pl_module.global_step)
            super()._install(pl_module)

    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed")], callbacks=[Counting(every_n_batches=3, print_table=False)], max_steps=7
    ).fit(TinyModel())
    assert inspected == [0, 3, 6]


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"every_n_batches": 0}, "every_n_batches=0"), ({"flag_share": 0.0}, "flag_share=0.0")]
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        PrecisionReport(**kwargs)


class Blocks(TinyModel):
    """``enc.0.attn`` / ``enc.1.attn`` are non-leaf blocks (two Linears each); an island pattern selects them."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), "ff": nn.Linear(8, 8)})
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.enc:
            x = block["ff"](block["attn"](x))
        return self.net(x)


def test_modules_inside_a_pattern_island_are_named_as_in_it():
    model = Blocks()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["enc.*.attn"])
    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[plugin], callbacks=[report], max_steps=1).fit(model)
    rows = {r["name"]: r for r in report.rows}
    for i in (0, 1):
        for leaf in (f"enc.{i}.attn.0", f"enc.{i}.attn.1"):
            assert rows[leaf]["island"] == f"enc.{i}.attn"
            assert rows[leaf]["output_dtype"] == "float32"
            assert (rows[leaf]["flagged"], rows[leaf]["cause"]) == (False, None)  # the island is the user's choice
        assert rows[f"enc.{i}.ff"]["island"] is None  # outside the island: float16, not flagged
        assert rows[f"enc.{i}.ff"]["output_dtype"] == "float16"
        assert not rows[f"enc.{i}.ff"]["flagged"]
    assert "enc.0.attnx" not in rows
    table = report.format_table()
    assert "fp32 islands: enc.0.attn, enc.1.attn" in table


def test_a_working_island_of_light_modules_is_visible_in_the_table():
    model = Mixed()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["net.1"])  # a ReLU: not heavy
    report = PrecisionReport(print_table=False, flag_share=1.0)  # flagged by type only (shares are noisy here)
    make_trainer(plugins=[plugin], callbacks=[report], max_steps=1).fit(model)
    rows = {r["name"]: r for r in report.rows}
    assert rows["net.1"]["island"] == "net.1"
    assert not rows["net.1"]["flagged"]
    assert [r["island"] for r in report.rows] == [None, "net.1", None, None]
    line = next(line for line in report.format_table().splitlines() if line.startswith("net.1 "))
    assert "fp32" in line.split()


def test_island_of_a_prefix_name_does_not_cover_its_siblings():
    from lightning_amp_plus.islands import island_of as _island_of

    assert _island_of("enc.10.attn", ["enc.1"]) is None
    assert _island_of("enc.1.attn", ["enc.1"]) == "enc.1"
    assert _island_of("enc.1", ["enc.1"]) == "enc.1"
    assert _island_of("enc.1.attn.0", ["enc", "enc.1.attn"]) == "enc.1.attn"  # the closest enclosing island


@pytest.mark.parametrize(("precision", "flag_head"), [("bf16-mixed", True), ("32-true", False)])
def test_works_with_any_precision_plugin(precision, flag_head):
    model = Mixed()
    report = PrecisionReport(print_table=False)
    make_trainer(precision=precision, callbacks=[report], max_steps=1).fit(model)  # Lightning's own plugins
    rows = {r["name"]: r for r in report.rows}
    assert list(rows) == ["net.0", "net.1", "net.2", "head"]
    assert rows["net.0"]["output_dtype"] == ("bfloat16" if precision == "bf16-mixed" else "float32")
    assert rows["head"]["flagged"] is flag_head  # fp32 heavy work is news only under mixed precision
    assert all(r["island"] is None for r in report.rows)


def test_the_table_word_for_word():
    from lightning_amp_plus import PrecisionReport

    def row(name, share, *, island=None, compiled=False, cause=None, flagged=False, kind="Linear"):
        return {
            "name": name,
            "type": kind,
            "input_dtype": "float16",
            "output_dtype": "float32" if flagged or island else "float16",
            "param_dtype": "float32",
            "time_ms": share * 10,
            "time_share": share,
            "island": island,
            "compiled": compiled,
            "cause": cause,
            "flagged": flagged,
        }

    rows = [
        row("enc.0", 0.5),
        row("head", 0.25, island="head", kind="LayerNorm"),
        row("body.1", 0.125, compiled=True),
        row("slow", 0.125, cause="autocast disabled around it", flagged=True),
    ]
    table = [
        "PrecisionReport (first inspected batch)",
        "module             type       in       out      param    time ms  share  island  flag",
        "enc.0              Linear     float16  float16  float32  5.000    50.0%",
        "head               LayerNorm  float16  float32  float32  2.500    25.0%  fp32",
        "body.1 [compiled]  Linear     float16  float16  float32  1.250    12.5%",
        "slow               Linear     float16  float32  float32  1.250    12.5%          autocast disabled around it",
        "fp32 islands: head",
    ]
    flagged = "1 module(s) do heavy work in float32 under mixed precision: slow"
    for replay, compiled in (
        (
            False,
            "[compiled]: a torch.compile'd submodule, read from outside its graph as one row"
            " (`PrecisionReport(replay_compiled=True)` replays it eagerly for its leaves).",
        ),
        (
            True,
            "[compiled]: inside a torch.compile'd submodule: dtypes and times from an eager replay of the inspected"
            " call (no grad, random state and buffers restored); the compiled kernels' own times are not measured.",
        ),
    ):
        report = PrecisionReport(print_table=False, replay_compiled=replay)
        report.rows, report._batches = rows, 0
        assert report.format_table() == "\n".join([*table, compiled, flagged])
    report._batches = 3
    report.rows = [row("a", 0.5, flagged=True), row("b", 0.5, flagged=True)]
    lines = report.format_table().splitlines()
    assert lines[0] == "PrecisionReport"
    assert lines[-1] == "2 module(s) do heavy work in float32 under mixed precision: a, b"
    assert len(lines) == 5


class _Clock:
    """A clock the modules move: each one's forward takes the ticks it is given, nothing else takes time."""

    now = 0.0

    @classmethod
    def perf_counter(cls):
        return cls.now


class _Ticks(nn.Module):
    def __init__(self, ticks):
        super().__init__()
        self.ticks = ticks

    def forward(self, x):
        _Clock.now += self.ticks
        return x


class _Timed(TinyModel):
    def __init__(self):
        super().__init__()
        self.heavy, self.light, self.unused = _Ticks(3.0), _Ticks(1.0), _Ticks(5.0)
        self.seen = []

    def forward(self, x):
        x = self.light(self.light(self.heavy(x)))  # the light one twice: its time adds up
        return self.net(x)


def test_time_shares_are_each_modules_own_time_and_a_module_that_never_ran_has_no_row(monkeypatch):
    from lightning_amp_plus.callbacks import precision_report

    _Clock.now = 0.0
    monkeypatch.setattr(precision_report.time, "perf_counter", _Clock.perf_counter)
    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[report], max_steps=1).fit(_Timed())
    rows = {r["name"]: r for r in report.rows}
    assert "unused" not in rows
    assert (rows["heavy"]["time_ms"], rows["light"]["time_ms"]) == (3000.0, 2000.0)
    assert (rows["heavy"]["time_share"], rows["light"]["time_share"]) == (0.6, 0.4)


class _TwoDtypes(TinyModel):
    def __init__(self):
        super().__init__()
        self.probe = nn.Identity()

    def forward(self, x):
        self.probe(x.half())
        self.probe(x.float())  # called again, in another dtype
        return self.net(x)


def test_a_modules_input_dtype_is_its_first_calls():
    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[report], max_steps=1).fit(_TwoDtypes())
    (probe,) = [r for r in report.rows if r["name"] == "probe"]
    assert probe["input_dtype"] == "float16"


def test_only_torchs_own_modules_are_timed_again():
    """`lowered_speedup` runs a flagged module again: only where all it runs is torch's own code."""
    from torch.nn.utils import parametrize

    from lightning_amp_plus.forensics._safe import torch_own

    class WSConv2d(nn.Conv2d):  # weight standardization: a method its forward calls is the user's
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, (w - w.mean()) / (w.std() + 1e-5), b)

    class Scale(nn.Module):
        def forward(self, w):
            return w * 2

    parametrized = nn.Linear(4, 4)
    parametrize.register_parametrization(parametrized, "weight", Scale())
    hooked = nn.Linear(4, 4)
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert torch_own(nn.Linear(4, 4))
    assert torch_own(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert not torch_own(WSConv2d(3, 4, 3))
    assert not torch_own(parametrized)
    assert not torch_own(hooked)
    assert not torch_own(nn.Sequential(WSConv2d(3, 4, 3)))


def test_a_subclass_of_a_torch_layer_runs_once_a_batch_with_the_report():
    calls = []

    class WSConv2d(nn.Conv2d):
        def _conv_forward(self, x, w, b):
            calls.append(1)
            return super()._conv_forward(x, w, b)

    class Convs(TinyModel):
        def __init__(self):
            super().__init__()
            self.conv = WSConv2d(1, 2, 3, padding=1)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):  # float32 heavy work: flagged
                h = self.conv(x.float()[:, None, None, :])
            return self.net(h.mean((1, 2)))

    for callbacks in ([], [PrecisionReport(print_table=False)]):
        calls.clear()
        make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=callbacks, max_steps=3).fit(Convs())
        assert len(calls) == 3, callbacks  # once a batch: the report never runs it again
    (row,) = [r for r in callbacks[0].rows if r["name"] == "conv"]
    assert row["flagged"]
    assert row["lowered_speedup"] is None  # not timed: not torch's own code


def test_heavy_modules_with_children_are_one_row_each():
    """`MultiheadAttention` (its `out_proj` is its own part) and a parametrized Linear (weight norm's way)."""
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return w * 1.0

    class Parts(TinyModel):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = nn.Linear(8, 8)
            parametrize.register_parametrization(self.proj, "weight", Scale())

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):  # float32 heavy work: both flagged
                h = self.proj(x.float())
                h = self.attn(h[:, None], h[:, None], h[:, None], need_weights=False)[0][:, 0]
            return self.net(h)

    report = PrecisionReport(print_table=False)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[report], max_steps=1).fit(Parts())
    rows = {r["name"]: r for r in report.rows}
    assert rows["attn"]["flagged"]
    assert rows["proj"]["flagged"]
    assert rows["proj"]["type"] == "ParametrizedLinear"
    assert not [name for name in rows if name.startswith(("attn.", "proj."))]  # their parts are no rows
    assert rows["proj"]["lowered_speedup"] is None  # a parametrization is code of yours: not timed again
