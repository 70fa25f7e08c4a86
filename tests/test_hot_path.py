"""The hot path's deterministic costs: Python calls and aten ops per step, ours against stock Lightning AMP's.

Counted as ``examples/benchmark.py --counts`` counts them (a long fit minus a short one), so the figures do not move
with the machine's load. The floors are stock AMP, or our plugin, with two empty callbacks: what Lightning's hook
dispatch charges any two callbacks. And what a watched module call costs, once the watch is on.
"""

import os

import pytest

# mutmut's trampolines are Python calls of their own: the counts mean nothing inside a mutation run
pytestmark = pytest.mark.skipif(bool(os.environ.get("MUTANT_UNDER_TEST")), reason="counts include mutmut's calls")

_BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "benchmark.py")


_COUNT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("amp_benchmark", sys.argv[1])
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)
make = benchmark.configs("cpu", "16-mixed", floor=True)[sys.argv[2]]
sizes, batch, clip = (256, 512, 4), 8, 1.0  # the benchmark's --size small
benchmark.count_fit(make, sizes, batch, 5, clip)  # what a first fit imports is not a step's cost
long_calls, long_ops = benchmark.count_fit(make, sizes, batch, 150, clip)
short_calls, short_ops = benchmark.count_fit(make, sizes, batch, 50, clip)
print(json.dumps([(long_calls - short_calls) / 100, (long_ops - short_ops) / 100]))
"""


@pytest.fixture(scope="module")
def per_step():
    """Python calls and aten ops a step of a configuration, counted in a fresh process (what earlier tests left in
    this one, a warnings filter or a compiled graph, does not count)."""
    import json
    import subprocess
    import sys

    def counts(name):
        done = subprocess.run(
            [sys.executable, "-c", _COUNT, _BENCHMARK, name],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(_BENCHMARK))},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        calls, ops = json.loads(done.stdout.strip().splitlines()[-1])
        return calls, ops

    return counts


def test_the_plugin_and_both_callbacks_cost_at_most_40_python_calls_a_step_over_two_empty_callbacks(per_step):
    floor_calls, floor_ops = per_step("stock AMP + 2 empty callbacks")
    ours_calls, ours_ops = per_step("AmpPlusPrecision + callbacks")
    assert ours_ops == floor_ops  # no aten op of ours on a clean step
    assert ours_calls - floor_calls <= 40, (ours_calls, floor_calls)


def test_both_callbacks_cost_at_most_13_python_calls_a_step_over_two_empty_ones_and_no_hook(per_step):
    """The forensics cost nothing on clean steps: no hook, no recorded call, no device op (the batch and the loss are
    kept by reference); what is left is the callbacks' bookkeeping."""
    floor_calls, floor_ops = per_step("AmpPlusPrecision + 2 empty callbacks")
    ours_calls, ours_ops = per_step("AmpPlusPrecision + callbacks")
    assert ours_ops == floor_ops
    # 10 on the current stack; 12.5 on the oldest (torch 2.4.1, Lightning 2.4.0), counted in a fresh process (in the
    # suite's own process earlier tests had it read 11.8)
    assert ours_calls - floor_calls <= 13, (ours_calls, floor_calls)


def test_the_plugin_alone_adds_no_aten_op_to_stock_amp(per_step):
    stock_calls, stock_ops = per_step("stock AMP")
    ours_calls, ours_ops = per_step("AmpPlusPrecision")
    assert ours_ops == stock_ops
    assert ours_calls - stock_calls <= 40, (ours_calls, stock_calls)


def test_auto_islands_cost_no_aten_op_and_at_most_12_python_calls_a_clean_step(per_step):
    """Before any skip ``auto_islands=True`` keeps the step's record (a batch slot and its losses): no hook, no read."""
    plain_calls, plain_ops = per_step("AmpPlusPrecision")
    auto_calls, auto_ops = per_step("AmpPlusPrecision(auto_islands=True)")
    assert auto_ops == plain_ops
    assert auto_calls - plain_calls <= 12, (auto_calls, plain_calls)  # 9 on the current stack


def _profiled(run) -> tuple[list[str], int]:
    """The Python functions ``run()`` calls (file:name), and the aten ops it dispatches."""
    import sys

    import torch

    names: list[str] = []
    ops = [0]

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            return func(*args, **(kwargs or {}))

    def profile(frame, event, arg):
        if event == "call":
            names.append(f"{frame.f_code.co_filename}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}")

    sys.setprofile(profile)  # apart from the op count: the dispatch mode's own Python would count
    try:
        run()
    finally:
        sys.setprofile(None)
    with Count():
        run()
    return names, ops[0]


def _profiled_with_noop_hooks(run):
    """:func:`_profiled` with two global module hooks that do nothing: torch's cost of a hooked call."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(lambda *a: None), register_module_forward_hook(lambda *a: None)]
    try:
        return _profiled(run)
    finally:
        for handle in handles:
            handle.remove()


def test_a_watched_module_call_costs_three_python_calls_of_ours_and_one_device_op_a_new_tensor():
    """The performance page's figures: per watched call, torch's global hooks before and after it (ours, filtering by
    module), the after-hook reading its inputs and its output (one walk each); per tensor not read before in the step,
    one ``aminmax``; a tensor an earlier call gave (a Sequential's input, a parent's output) is not read again."""
    import torch
    from torch import nn

    from lightning_amp_plus.forensics.observe import Watch

    model = nn.Module()
    model.outer = nn.Sequential(nn.Linear(4, 4))  # the step calls `outer`; `outer` calls its Linear
    x = torch.randn(2, 4)
    plain_names, plain_ops = _profiled(lambda: model.outer(x.clone()))
    hooked_names, hooked_ops = _profiled_with_noop_hooks(lambda: model.outer(x.clone()))
    watch = Watch()
    watch.install(model)
    try:
        trace = watch.begin()
        names, ops = _profiled(lambda: model.outer(x.clone()))
    finally:
        watch.remove()
    assert len(trace) == 8  # two runs of two calls, each with its inputs and its output
    ours = [name.rsplit(":", 1)[1] for name in names if "lightning_amp_plus" in name]
    qualified = hasattr(_profiled.__code__, "co_qualname")  # Python 3.11+
    before, after = ("Watch._before", "Watch._after") if qualified else ("_before", "_after")
    read = ["Watch._read_safely" if qualified else "_read_safely", "_extremes"]
    # per call: torch's global hook (the dispatcher), the watch's hook, each reading once (inputs as the call
    # starts, its output as it ends)
    one_run = ["_before", before, *read, "_before", before, *read]
    one_run += ["_after", after, *read, "_after", after, *read]
    assert ours == one_run
    # over torch's own dispatch of two hooked calls (global hooks that do nothing): ours, and torch.compiler's check
    # in each dispatcher (`is_compiling` and its `is_scripting`: 8), less the do-nothing hooks' own calls (4)
    assert len(names) - len(hooked_names) == len(ours) + 8 - 4
    assert hooked_ops == plain_ops
    # Linear's input and output, one aminmax each; `outer`'s are the same tensors: read once (a new input each run)
    assert ops - plain_ops == 2
