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
    # the island receives float16 from net.1 and casts it: float32 out
    assert rows["net.2"]["input_dtype"] == "float16"
    assert rows["net.2"]["output_dtype"] == "float32"
    assert rows["net.2"]["flagged"]
    assert "fp32 island" in rows["net.2"]["cause"]
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
