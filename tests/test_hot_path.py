"""The hot path's deterministic costs: Python calls and aten ops per step, ours against stock Lightning AMP's.

Counted as ``examples/benchmark.py --counts`` counts them (a long fit minus a short one), so the figures do not move
with the machine's load. The floor is stock AMP with two empty callbacks: what Lightning's hook dispatch charges any
two callbacks.
"""

import importlib.util
import os

import pytest

# mutmut's trampolines are Python calls of their own: the counts mean nothing inside a mutation run
pytestmark = pytest.mark.skipif(bool(os.environ.get("MUTANT_UNDER_TEST")), reason="counts include mutmut's calls")

_BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "benchmark.py")


@pytest.fixture(scope="module")
def per_step():
    spec = importlib.util.spec_from_file_location("amp_benchmark", _BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    table = benchmark.configs("cpu", "16-mixed", floor=True)
    sizes, batch, clip = (256, 512, 4), 8, 1.0  # the benchmark's --size small

    def counts(name):
        long_calls, long_ops = benchmark.count_fit(table[name], sizes, batch, 150, clip)
        short_calls, short_ops = benchmark.count_fit(table[name], sizes, batch, 50, clip)
        return (long_calls - short_calls) / 100, (long_ops - short_ops) / 100

    return counts


def test_the_plugin_and_both_callbacks_cost_at_most_40_python_calls_a_step_over_two_empty_callbacks(per_step):
    floor_calls, floor_ops = per_step("stock AMP + 2 empty callbacks")
    ours_calls, ours_ops = per_step("AmpPlusPrecision + callbacks")
    assert ours_ops == floor_ops  # no aten op of ours on a clean step
    assert ours_calls - floor_calls <= 40, (ours_calls, floor_calls)


def test_the_plugin_alone_adds_no_aten_op_to_stock_amp(per_step):
    stock_calls, stock_ops = per_step("stock AMP")
    ours_calls, ours_ops = per_step("AmpPlusPrecision")
    assert ours_ops == stock_ops
    assert ours_calls - stock_calls <= 40, (ours_calls, stock_calls)


def test_a_recorded_module_call_costs_two_python_calls_of_ours():
    import contextlib
    import sys

    import torch
    from torch import nn

    from lightning_amp_plus.origins import OriginFinder

    model = nn.Module()
    model.layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def calls() -> list[str]:
        names = []

        def profile(frame, event, arg):
            if event == "call":
                names.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

        sys.setprofile(profile)
        model.layer(x)
        sys.setprofile(None)
        return names

    plain = calls()
    finder = OriginFinder()
    finder.attach(model, contextlib.nullcontext)
    finder.start_batch(x)
    recorded = calls()
    assert len(finder.current.calls) == 1  # it was recorded
    ours = [name.rsplit(":", 1)[1] for name in recorded if "lightning_amp_plus" in name]
    assert ours == ["keep", "versions"]  # the hook and its version read (the docs' "two ours")
    assert len(recorded) - len(plain) <= 5  # with torch's own dispatch of a hooked module (3 on torch 2.13)
