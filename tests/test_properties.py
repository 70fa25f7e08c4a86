"""Property tests (hypothesis): the boundaries stay closed for any knob, overflow, restart point or corruption."""

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric import Fabric
from torch import nn

from lightning_amp_plus import AmpPlusFabricPrecision, DynamicLossScaler

FLOAT32_MAX = 3.4028234663852886e38
TINY = 2.0**-126
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: tests/conftest.py

edge_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, TINY, TINY / 2, 1e-39, 1e-45, FLOAT32_MAX, 3.5e38, 1e39, 1e308, 1.0, 2.0, 0.5]),
    st.floats(min_value=1e-6, max_value=1e6),
)
edge_ints = st.one_of(st.integers(), st.sampled_from([0, 1, 2, 2**31 - 1, 2**31, -1]))
knobs = st.fixed_dictionaries(
    {},
    optional={
        "init_scale": edge_floats,
        "growth_factor": edge_floats,
        "backoff_factor": edge_floats,
        "growth_interval": edge_ints,
        "min_scale": edge_floats,
        "max_scale": edge_floats,
        "hysteresis": edge_ints,
    },
)


def _cycle(scaler, model, opt, overflow, nan=False):
    loss = model(torch.ones(2, 4)).pow(2).mean()
    if overflow:
        loss = loss * (float("nan") if nan else float("inf"))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@SETTINGS
@given(kwargs=knobs, pattern=st.lists(st.booleans(), min_size=1, max_size=30))
def test_any_knobs_are_refused_by_name_or_keep_the_weights_finite(kwargs, pattern):
    try:
        scaler = DynamicLossScaler("cpu", **kwargs)
    except (TypeError, ValueError) as error:
        assert any(f"{name}=" in str(error) for name in kwargs), str(error)  # noqa: PT017 - names the argument
        return
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731 - the scale lives in float32
    low, high = f32(max(scaler.min_scale, TINY)), f32(scaler.max_scale)
    for index, overflow in enumerate(pattern):
        before = [p.detach().clone() for p in model.parameters()]
        _cycle(scaler, model, opt, overflow, nan=index % 2 == 1)
        scale = scaler.get_scale()
        assert math.isfinite(scale)
        assert low <= scale <= high
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if overflow:  # a skipped step leaves the weights bit-identical
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _fabric_run(plugin, steps, overflows, state=None):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        plugin.load_state_dict(state["plugin"])
    fmodel, fopt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 4, generator=g) for _ in range(max(steps) + 1)]
    for step in steps:
        loss = fmodel(batches[step]).float().pow(2).mean()
        if step in overflows:
            loss = loss * float("inf")
        fabric.backward(loss)
        fabric.clip_gradients(fmodel, fopt, max_norm=1.0, error_if_nonfinite=False)
        fopt.step()
        fopt.zero_grad()
    return {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "plugin": plugin.state_dict(),
    }


@SETTINGS
@given(
    overflows=st.sets(st.integers(0, 23), max_size=10),
    restart=st.integers(1, 23),
    hysteresis=st.integers(1, 3),
    growth_interval=st.integers(1, 5),
)
def test_a_restart_anywhere_gives_the_uninterrupted_run(overflows, restart, hysteresis, growth_interval):
    def plugin():
        return AmpPlusFabricPrecision(
            "16-mixed", init_scale=2.0**10, hysteresis=hysteresis, growth_interval=growth_interval, min_scale=2.0**-4
        )

    whole = plugin()
    full = _fabric_run(whole, range(24), overflows)
    first = _fabric_run(plugin(), range(restart), overflows)
    resumed = plugin()
    second = _fabric_run(resumed, range(restart, 24), overflows, state=first)
    for name, value in full["model"].items():
        assert torch.equal(value, second["model"][name])
    assert resumed.history.curve() == whole.history.curve()
    assert resumed.history.skipped_steps == whole.history.skipped_steps
    assert overflows <= set(whole.history.skipped_steps)  # and any natural fp16 overflow, the same in both
    assert second["plugin"] == full["plugin"]


_STATE = None


def _saved_state():
    global _STATE
    if _STATE is None:
        _STATE = _fabric_run(AmpPlusFabricPrecision("16-mixed", init_scale=64.0, hysteresis=2), range(6), {2})["plugin"]
    return copy.deepcopy(_STATE)


junk = st.one_of(
    st.none(),
    st.booleans(),
    edge_ints,
    edge_floats,
    st.text(max_size=5),
    st.lists(st.integers(-3, 10), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@SETTINGS
@given(data=st.data())
def test_a_corrupted_state_is_refused_by_name_or_loads_correctly(data):
    state = _saved_state()
    keys = sorted(state) + [f"history.{k}" for k in sorted(state["history"])]
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        target, name = (state.get("history"), key.split(".", 1)[1]) if key.startswith("history.") else (state, key)
        if not isinstance(target, dict):
            continue  # the whole history was replaced already
        if data.draw(st.booleans()):
            target.pop(name, None)
        else:
            target[name] = data.draw(junk)
    plugin = AmpPlusFabricPrecision("16-mixed", init_scale=2.0**12)
    try:
        plugin.load_state_dict(state)
    except (TypeError, ValueError) as error:
        message = str(error)
        assert "AmpPlusFabricPrecision.load_state_dict" in message or "DynamicLossScaler.load_state_dict" in message
        assert plugin.loss_scale == 2.0**12  # nothing half-loaded
        assert plugin.history.num_steps == 0
        return
    # loaded: what it holds is a valid state the run can continue from
    scaler = plugin.scaler
    assert math.isfinite(scaler.get_scale())
    assert max(scaler.min_scale, TINY) <= scaler.get_scale() <= scaler.max_scale
    assert 0 < scaler.get_backoff_factor() < 1 < scaler.get_growth_factor()
    _fabric_run(plugin, range(3), {1})
    assert plugin.history.num_steps >= 3
    assert math.isfinite(plugin.loss_scale)


def test_property_tests_run_with_hypothesis_installed():
    pytest.importorskip("hypothesis")
