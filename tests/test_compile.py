"""torch.compile: a compiled model or submodule trains under the plugin with every callback, as the eager one."""

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import (
    AmpPlusPrecision,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from tests.helpers.models import TinyModel
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
    assert [r["name"] for r in c_report.rows] == [r["name"] for r in e_report.rows] == ["net.0", "net.1", "net.2"]
    assert [r["output_dtype"] for r in c_report.rows] == [r["output_dtype"] for r in e_report.rows]


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
