import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_amp_plus import DynamicLossScaler


def reference_rule(scale, growth, hyst, overflow, *, gf, bf, gi, lo, hi, h):
    """The update rule written out in plain Python (float32 rounding as torch's kernel does)."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float64).float().item()  # noqa: E731
    if overflow:
        growth = 0
        hyst = max(hyst - 1, 0)
        if hyst <= 0:
            scale = max(f32(scale * bf), lo)
    else:
        growth += 1
        if growth >= gi:
            growth = 0
            hyst = h
            grown = f32(scale * gf)
            scale = min(grown, hi) if math.isfinite(grown) else scale
    return scale, growth, hyst


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt


def _cycle(scaler, model, opt, x, overflow):
    loss = model(x).pow(2).mean()
    if overflow:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_torch_gradscaler_exactly(seed):
    rng = random.Random(seed)
    gf, bf, gi = rng.choice([2.0, 1.7, 3.0]), rng.choice([0.5, 0.3, 0.77]), rng.randint(1, 4)
    init = rng.choice([2.0**16, 1000.0, 3.3])
    overflows = [rng.random() < 0.3 for _ in range(60)]
    m1, o1 = _setup(seed)
    m2, o2 = _setup(seed)
    ref = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=gi)
    ours = DynamicLossScaler(
        "cpu",
        init_scale=init,
        growth_factor=gf,
        backoff_factor=bf,
        growth_interval=gi,
        min_scale=0.0,
        max_scale=float("inf"),
        hysteresis=1,
    )
    g = torch.Generator().manual_seed(seed)
    for overflow in overflows:
        x = torch.randn(3, 4, generator=g)
        _cycle(ref, m1, o1, x, overflow)
        _cycle(ours, m2, o2, x, overflow)
        assert ours.get_scale() == ref.get_scale()
        assert ours._get_growth_tracker() == ref._get_growth_tracker()
        for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=False):
            assert torch.equal(p1, p2)
    assert any(overflows)


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_follows_reference_rule_with_bounds_and_hysteresis(hysteresis, seed):
    rng = random.Random(seed + 10 * hysteresis)
    knobs = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=4.0, max_scale=64.0)
    scaler = DynamicLossScaler("cpu", init_scale=16.0, hysteresis=hysteresis, **knobs)
    model, opt = _setup(seed)
    scale, growth, hyst = 16.0, 0, hysteresis
    # long overflow bursts reach min_scale, long clean runs reach max_scale
    pattern = [True] * 8 + [False] * 20 + [rng.random() < 0.4 for _ in range(80)]
    seen_min = seen_max = False
    for overflow in pattern:
        _cycle(scaler, model, opt, torch.randn(3, 4), overflow)
        scale, growth, hyst = reference_rule(
            scale,
            growth,
            hyst,
            overflow,
            gf=2.0,
            bf=0.5,
            gi=3,
            lo=4.0,
            hi=64.0,
            h=hysteresis,
        )
        assert scaler.get_scale() == scale
        assert scaler._get_growth_tracker() == growth
        if hysteresis > 1:
            assert scaler._get_hysteresis_tracker() == hyst
        seen_min |= scale == 4.0
        seen_max |= scale == 64.0
    assert seen_min
    assert seen_max


def test_hysteresis_delays_backoff():
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, hysteresis=3, growth_interval=100)
    model, opt = _setup()
    scales = []
    for _ in range(4):
        _cycle(scaler, model, opt, torch.randn(3, 4), True)
        scales.append(scaler.get_scale())
    # two overflows tolerated, then every further overflow backs off until a growth resets the tracker
    assert scales == [1024.0, 1024.0, 512.0, 256.0]


def test_skipped_step_leaves_parameters_bit_identical():
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    _cycle(scaler, model, opt, torch.randn(3, 4), True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
    assert scaler.step_was_skipped(opt) is True
    _cycle(scaler, model, opt, torch.randn(3, 4), False)
    assert scaler.step_was_skipped(opt) is False
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_update_runs_on_device_without_sync(hysteresis):
    scaler = DynamicLossScaler("cpu", init_scale=8.0, hysteresis=hysteresis)
    model, opt = _setup()
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    with SyncCounter() as counter:
        scaler.update()
    assert counter.count == 0


def test_state_dict_round_trip_carries_every_tracker():
    scaler = DynamicLossScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=5, min_scale=2.0)
    model, opt = _setup()
    for overflow in [True, False, False]:
        _cycle(scaler, model, opt, torch.randn(3, 4), overflow)
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 2  # one overflow spent; clean steps do not refill it, a growth does
    assert state["_growth_tracker"] == 2
    assert state["min_scale"] == 2.0
    assert state["hysteresis"] == 3
    _cycle(scaler, model, opt, torch.randn(3, 4), True)
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 1
    fresh = DynamicLossScaler("cpu")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # a lazily initialised scaler keeps the loaded trackers once it starts
    _cycle(fresh, model, opt, torch.randn(3, 4), True)
    assert fresh.get_scale() == 128.0  # hysteresis exhausted: backs off immediately


def test_loads_a_plain_gradscaler_state():
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ours = DynamicLossScaler("cpu")
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == 512.0
    assert ours.get_growth_interval() == 7
    assert ours.min_scale == 1.0


def test_pickles_between_iterations():
    import pickle

    scaler = DynamicLossScaler("cpu", init_scale=64.0, hysteresis=2)
    model, opt = _setup()
    _cycle(scaler, model, opt, torch.randn(3, 4), True)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 64.0
    assert clone._get_hysteresis_tracker() == 1


def test_disabled_scaler_is_a_pass_through():
    scaler = DynamicLossScaler("cpu", enabled=False)
    model, opt = _setup()
    _cycle(scaler, model, opt, torch.randn(3, 4), False)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"growth_factor": 1.0}, ValueError, r"growth_factor=1.0\)` is invalid: expected a finite number > 1"),
        ({"growth_factor": "2"}, TypeError, r"growth_factor='2'\)` is invalid: expected a real number, got str"),
        ({"backoff_factor": 1.0}, ValueError, r"backoff_factor=1.0\)` is invalid: expected 0 < backoff_factor < 1"),
        ({"backoff_factor": 0}, ValueError, r"backoff_factor=0.0\)` is invalid: expected 0 < backoff_factor < 1"),
        ({"init_scale": 0.0}, ValueError, r"init_scale=0.0\)` is invalid: expected a finite float32 scale in"),
        ({"init_scale": float("inf")}, ValueError, r"init_scale=inf\)` is invalid: expected a finite float32 scale in"),
        ({"growth_interval": 0}, ValueError, r"growth_interval=0\)` is invalid: expected an int in \[1, 2147483647\]"),
        ({"growth_interval": 2.0}, TypeError, r"growth_interval=2.0\)` is invalid: expected an int, got float"),
        ({"hysteresis": 0}, ValueError, r"hysteresis=0\)` is invalid: expected an int in \[1, 2147483647\]"),
        ({"hysteresis": True}, TypeError, r"hysteresis=True\)` is invalid: expected an int, got bool"),
        (
            {"min_scale": -1.0},
            ValueError,
            r"min_scale=-1.0\)` is invalid: expected 0 \(no bound but float32's\) or a finite float32",
        ),
        ({"max_scale": 0.0}, ValueError, r"max_scale=0.0\)` is invalid: expected inf or a finite float32 scale"),
        (
            {"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0},
            ValueError,
            r"min_scale=8.0, max_scale=4.0\)` is invalid: expected min_scale <= max_scale",
        ),
        ({"init_scale": 2.0**30}, ValueError, r"expected min_scale <= init_scale <= max_scale.*HINT"),
        ({"enabled": 1}, TypeError, r"enabled=1\)` is invalid: expected a bool"),
        # what float32 cannot hold on the device: refused, never a scale of 0 or inf at step 0
        (
            {"init_scale": 1e-50, "min_scale": 0},
            ValueError,
            r"init_scale=1e-50\)` is invalid: expected a finite float32",
        ),
        (
            {"init_scale": 1e-39, "min_scale": 0},
            ValueError,
            r"init_scale=1e-39\)` is invalid: expected a finite float32",
        ),
        (
            {"init_scale": 1e39, "max_scale": math.inf},
            ValueError,
            r"init_scale=1e\+39\)` is invalid: expected a finite",
        ),
        ({"growth_factor": 1e308}, ValueError, r"growth_factor=1e\+308\)` is invalid: .*float32 can hold"),
        ({"backoff_factor": 1e-300}, ValueError, r"backoff_factor=1e-300\)` is invalid: expected 0 < backoff"),
        ({"min_scale": 1e-40}, ValueError, r"min_scale=1e-40\)` is invalid: expected 0 \(no bound"),
        ({"max_scale": 1e39}, ValueError, r"max_scale=1e\+39\)` is invalid: expected inf or a finite float32"),
        ({"growth_interval": 2**31}, ValueError, r"growth_interval=2147483648\)` is invalid: .*int32"),
        ({"hysteresis": 2**40}, ValueError, r"hysteresis=1099511627776\)` is invalid: .*int32"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=r"`DynamicLossScaler\(.*" + match):
        DynamicLossScaler("cpu", **kwargs)


def test_positional_arguments_are_torch_gradscalers():
    ours = DynamicLossScaler("cpu", 1024.0, 3.0, 0.25, 7, True, min_scale=2.0, hysteresis=2)
    ref = torch.amp.GradScaler("cpu", 1024.0, 3.0, 0.25, 7, True)
    assert ours.get_scale() == ref.get_scale() == 1024.0
    assert ours.get_growth_factor() == ref.get_growth_factor() == 3.0
    assert ours.get_backoff_factor() == ref.get_backoff_factor() == 0.25
    assert ours.get_growth_interval() == ref.get_growth_interval() == 7
    assert ours.is_enabled()
    assert (ours.min_scale, ours.hysteresis) == (2.0, 2)
    assert not DynamicLossScaler("cpu", 1024.0, 3.0, 0.25, 7, False).is_enabled()


def test_found_inf_between_two_steps_does_not_hide_the_second_overflow():
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=256.0)
    x = torch.randn(3, 4)
    loss = a(x).sum() + b(x).sum()
    handle = b.weight.register_hook(lambda g: g * float("inf"))
    scaler.scale(loss).backward()
    handle.remove()
    scaler.step(opt_a)
    assert scaler.found_inf().item() == 0  # a's flag only, so far
    scaler.step(opt_b)
    assert scaler.found_inf().item() > 0  # b's overflow joined the cycle
    scaler.update()
    assert scaler.get_scale() == 128.0


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_min_scale_zero_backs_off_to_float32s_smallest_normal_never_zero(hysteresis):
    scaler = DynamicLossScaler("cpu", init_scale=2.0**-120, min_scale=0, backoff_factor=2.0**-10, hysteresis=hysteresis)
    model, opt = _setup()
    for _ in range(2 * hysteresis):
        _cycle(scaler, model, opt, torch.randn(3, 4), True)
    assert scaler.get_scale() == 2.0**-126  # float32's smallest normal: its inverse is finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _cycle(scaler, model, opt, torch.randn(3, 4), False)  # a clean step still applies a finite update
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_load_state_dict_into_a_scaler_that_already_ran():
    src = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=5, hysteresis=3)
    model, opt = _setup()
    _cycle(src, model, opt, torch.randn(3, 4), False)
    _cycle(src, model, opt, torch.randn(3, 4), True)  # growth tracker 0, hysteresis tracker 2
    dst = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=5, hysteresis=3)
    _cycle(dst, model, opt, torch.randn(3, 4), False)
    _cycle(dst, model, opt, torch.randn(3, 4), False)  # its device trackers exist: 2 and 3
    dst.load_state_dict(src.state_dict())
    assert dst.state_dict() == src.state_dict()
    assert int(dst._growth_tracker) == 0
    assert int(dst._hysteresis_tracker) == 2
    for overflow in (True, True, False):  # the loaded trackers drive the rule: back off on the 2nd overflow
        _cycle(src, model, opt, torch.randn(3, 4), overflow)
        _cycle(dst, model, opt, torch.randn(3, 4), overflow)
        assert dst.get_scale() == src.get_scale()
    assert dst.get_scale() == 32.0


def test_loaded_scale_outside_the_bounds_is_brought_inside_and_said(caplog):
    stock = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # a stock run's scale above our max_scale
    ours = DynamicLossScaler("cpu", max_scale=2.0**24)
    ours.load_state_dict(stock.state_dict())
    assert ours.get_scale() == 2.0**24
    assert "scale 1073741824.0 -> 16777216.0 (brought inside [min_scale, max_scale]" in caplog.text
    low = DynamicLossScaler("cpu", min_scale=4.0, init_scale=8.0)
    low.load_state_dict(torch.amp.GradScaler("cpu", init_scale=0.5).state_dict())
    assert low.get_scale() == 4.0


def test_loaded_knobs_replace_the_constructors_and_are_said(caplog):
    ours = DynamicLossScaler("cpu", growth_interval=100)
    ours.load_state_dict(DynamicLossScaler("cpu", growth_interval=7, hysteresis=2).state_dict())
    assert ours.get_growth_interval() == 7
    assert ours.hysteresis == 2
    assert "growth_interval 100 -> 7; hysteresis 1 -> 2" in caplog.text
    caplog.clear()
    ours.load_state_dict(ours.state_dict())
    assert caplog.text == ""  # nothing changed, nothing said


def _state(**changes):
    state = DynamicLossScaler("cpu", init_scale=64.0, hysteresis=2).state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        (_state(scale=0.0), ValueError, r"`DynamicLossScaler.load_state_dict\(scale=0.0\)` is invalid"),
        (
            _state(scale=float("nan")),
            ValueError,
            r"load_state_dict\(scale=nan\)` is invalid: expected a finite float32",
        ),
        (_state(scale=float("inf")), ValueError, r"load_state_dict\(scale=inf\)` is invalid"),
        (_state(scale=1e-40), ValueError, r"load_state_dict\(scale=1e-40\)` is invalid"),
        (_state(min_scale=8.0, max_scale=4.0), ValueError, r"min_scale=8.0, max_scale=4.0\)` is invalid"),
        (_state(backoff_factor=3), ValueError, r"load_state_dict\(backoff_factor=3.0\)` is invalid"),
        (_state(hysteresis=0), ValueError, r"load_state_dict\(hysteresis=0\)` is invalid"),
        (_state(_hysteresis_tracker=-1), ValueError, r"_hysteresis_tracker=-1\)` is invalid: expected an int in"),
        (
            _state(_hysteresis_tracker=5),
            ValueError,
            r"_hysteresis_tracker=5\)` is invalid: expected an int in \[0, hyst",
        ),
        (_state(growth_interval=0), ValueError, r"load_state_dict\(growth_interval=0\)` is invalid"),
        (
            _state(_growth_tracker=-1),
            ValueError,
            r"_growth_tracker=-1\)` is invalid: expected an int in \[0, 2147483647\]",
        ),
        (_state(_growth_tracker=2**31), ValueError, r"_growth_tracker=2147483648\)` is invalid"),
        (_state(scale="big"), TypeError, r"load_state_dict\(scale='big'\)` is invalid: expected a real number"),
        ({"scale": 2.0}, ValueError, r"the state lacks 'growth_factor', 'backoff_factor'.*expected a `GradScaler"),
        ({}, ValueError, r"the state lacks 'scale'.*no keys"),
        (None, TypeError, r"expected a dict"),
    ],
)
def test_invalid_states_are_refused_and_nothing_is_loaded(state, error, match):
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10)
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_loads_a_tracker_of_zero_and_a_tensor_scale():
    state = DynamicLossScaler("cpu", init_scale=64.0, hysteresis=3).state_dict()
    state.update(_hysteresis_tracker=0, scale=torch.tensor(32.0))  # mid-backoff; a scale saved as a tensor
    scaler = DynamicLossScaler("cpu", hysteresis=3)
    scaler.load_state_dict(state)
    assert scaler.get_scale() == 32.0
    assert scaler._get_hysteresis_tracker() == 0


def test_sharded_scaler_skips_on_the_other_ranks_overflow_and_reduces_over_the_given_group(monkeypatch):
    """One rank's shard is clean, the other's overflowed: the flag is summed over the group the scaler was given,
    so this rank skips and backs off too; a plain DynamicLossScaler does not reduce."""
    import torch

    from lightning_amp_plus import ShardedDynamicLossScaler
    from tests.helpers.sharded import FakePeer

    peer = FakePeer(monkeypatch, lambda tensor, op: torch.ones_like(tensor))  # the other rank found inf
    group = object()
    scaler = ShardedDynamicLossScaler("cpu", 1024.0, process_group=group)  # init_scale by position, as torch's
    model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    _cycle(scaler, model, opt, torch.ones(3, 4), overflow=False)
    assert scaler.step_was_skipped(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 512.0
    assert [c["group"] for c in peer.calls] == [group]
    assert float(peer.calls[0]["mine"]) == 0.0  # this rank's own shard was clean

    peer.calls.clear()
    plain = DynamicLossScaler("cpu", init_scale=1024.0)
    _cycle(plain, model, opt, torch.ones(3, 4), overflow=False)
    assert not plain.step_was_skipped(opt)
    assert plain.get_scale() == 1024.0
    assert peer.calls == []


def test_sharded_checker_reduces_and_a_plain_checker_does_not(monkeypatch):
    import torch

    from lightning_amp_plus import NonFiniteChecker
    from tests.helpers.sharded import FakePeer

    peer = FakePeer(monkeypatch, lambda tensor, op: torch.ones_like(tensor))
    for sharded in (True, False):
        model, opt = _setup()
        checker = NonFiniteChecker(sharded=sharded, process_group="group-b")
        checker.scale(model(torch.ones(3, 4)).sum()).backward()
        checker.step(opt)
        checker.update()
        assert checker.step_was_skipped(opt) is sharded
    assert [call["group"] for call in peer.calls] == ["group-b"]  # the group it was given; the plain one never reduces
    assert repr(NonFiniteChecker(sharded=True, process_group="group-b")) == (
        "NonFiniteChecker(sharded=True, process_group='group-b')"
    )


class _KwargSGD(torch.optim.SGD):
    """A closure optimizer whose step takes an extra keyword, recording what it received."""

    def step(self, closure=None, *, tag=None):
        self.tags = [*getattr(self, "tags", []), tag]
        return super().step(closure)


def test_checker_closure_steps_pass_keywords_on_refuse_a_second_step_and_take_fp16_gradients():
    from lightning_amp_plus import NonFiniteChecker

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()  # float16 parameters and gradients: scale 1 may "unscale" them
    opt = _KwargSGD(model.parameters(), lr=0.5)
    checker = NonFiniteChecker()
    x = torch.ones(3, 4, dtype=torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    grads = []

    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        grads[:] = [p.grad.clone() for p in model.parameters()]
        return loss

    checker.step(opt, closure=closure, tag="mine")
    assert opt.tags == ["mine"]
    assert not checker.step_was_skipped(opt)
    for b, p, g in zip(before, model.parameters(), grads, strict=True):
        assert torch.equal(p.detach(), b - 0.5 * g)  # what the optimizer consumed: the gradients, unchanged
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update\(\)\.$"):
        checker.step(opt, closure=closure)
    checker.update()
    checker.step(opt, closure)  # the closure by position
    assert opt.tags == ["mine", None]
    other = _KwargSGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    checker.step(other, closure=lambda: torch.zeros(()))  # another optimizer in the same cycle steps too
    assert other.tags == [None]


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_a_pickled_scaler_continues_exactly_as_the_original(hysteresis):
    """Pickled between iterations (mid-hysteresis, mid-growth): the copy makes the same decisions from there on, and
    knows nothing of steps it did not make."""
    import copy
    import pickle

    scaler = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=3, hysteresis=hysteresis)
    model, opt = _setup()
    for overflow in (False, True, False):
        _cycle(scaler, model, opt, torch.ones(3, 4), overflow)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.step_was_skipped(opt) is None
    clone_model = copy.deepcopy(model)
    clone_opt = torch.optim.SGD(clone_model.parameters(), lr=0.01)
    pattern = [False, True, True, False, False, False, True, False, False, False, False]
    seen = {"original": [], "clone": []}
    for overflow in pattern:
        for key, s, m, o in (("original", scaler, model, opt), ("clone", clone, clone_model, clone_opt)):
            _cycle(s, m, o, torch.ones(3, 4), overflow)
            seen[key].append((s.get_scale(), s._get_growth_tracker(), s._get_hysteresis_tracker()))
    assert seen["clone"] == seen["original"]
    assert len({scale for scale, _, _ in seen["original"]}) > 2  # it backed off and grew in the continuation


def test_setter_errors_and_repr_name_the_class_the_user_holds():
    from lightning_amp_plus import ShardedDynamicLossScaler

    with pytest.raises(ValueError, match=r"^`ShardedDynamicLossScaler\.set_growth_interval\(growth_interval=0\)` is"):
        ShardedDynamicLossScaler("cpu").set_growth_interval(0)
    group = "group-a"  # what a user passes is shown as given, beside the knobs that differ from the defaults
    assert repr(ShardedDynamicLossScaler("cpu", process_group=group, growth_interval=7)) == (
        "ShardedDynamicLossScaler(process_group='group-a', device='cpu', growth_interval=7)"
    )


def test_repr_shows_the_knobs_as_they_are_now():
    """A setter (or a loaded checkpoint) moves a knob away from its default: the repr says so, given or not."""
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    assert repr(scaler) == "DynamicLossScaler(device='cpu', init_scale=8.0)"
    scaler.set_growth_interval(5)
    scaler.set_backoff_factor(0.5)  # back to its default
    assert repr(scaler) == "DynamicLossScaler(device='cpu', init_scale=8.0, growth_interval=5)"


def test_the_sharded_scaler_takes_the_plain_ones_defaults():
    import inspect

    from lightning_amp_plus import ShardedDynamicLossScaler

    def defaults(cls):
        return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}

    sharded, plain = defaults(ShardedDynamicLossScaler), defaults(DynamicLossScaler)
    assert sharded.pop("process_group") is None
    assert {n: v for n, v in sharded.items() if n not in ("args", "kwargs")} == {"device": plain["device"]}
    assert plain["device"] == "cuda"  # like torch.amp.GradScaler


class Recording(torch.optim.SGD):
    """A user's optimizer whose ``step`` takes more than a closure: what reaches it is kept."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.calls = []

    def step(self, closure=None, *args, **kwargs):
        self.calls.append((closure is not None, args, kwargs))
        if closure is not None:
            closure()
        return "stepped"


def test_the_checker_passes_every_argument_to_the_optimizer():
    from lightning_amp_plus import NonFiniteChecker

    model = torch.nn.Linear(2, 1)
    opt = Recording(model.parameters())
    checker = NonFiniteChecker()

    def closure():
        opt.zero_grad()
        loss = checker.scale(model(torch.ones(1, 2)).sum())
        loss.backward()
        return loss

    closure()
    assert checker.step(opt, None, "extra", key=1) == "stepped"  # no closure: torch's path
    checker.update()
    assert checker.step(opt, closure, "extra", key=2) == "stepped"  # a closure given by position
    checker.update()
    assert checker.step(opt, "extra", closure=closure, key=3) == "stepped"
    assert opt.calls == [
        (False, ("extra",), {"key": 1}),
        (True, ("extra",), {"key": 2}),
        (True, ("extra",), {"key": 3}),
    ]


def test_a_fused_step_is_resolved_once_and_then_known_without_a_sync():
    from lightning_amp_plus.syncs import HostSyncCounter

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    scaler.step(opt)  # decided on the device: the host does not know yet
    with HostSyncCounter() as counter:
        assert scaler.step_was_skipped(opt, sync=False) is None
        assert counter.count == 0
        assert scaler.step_was_skipped(opt) is True  # the default reads the flag: one sync
        assert scaler.step_was_skipped(opt, sync=False) is True  # then known on the host
        assert counter.count == 1


def test_a_reset_forgets_the_cycle_and_reads_nothing_back_on_its_first_clean_update():
    from lightning_amp_plus.syncs import HostSyncCounter

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=3)
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    scaler.step(opt)
    assert scaler.found_inf().item() > 0
    scaler.reset()
    with pytest.raises(AssertionError):  # no flag of the forgotten cycle is left to read
        scaler.found_inf()
    opt.zero_grad()
    with HostSyncCounter() as counter:
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)  # torch reads the flag of a non-fused step: the one sync
        scaler.update()  # the host knows the growth tracker after a reset: nothing read back
    assert counter.count == 1
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_a_device_decided_run_grows_after_exactly_growth_interval_clean_updates(hysteresis):
    """A fused optimizer's outcome is not on the host: every update runs the rule on the device, counting one each."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=3, hysteresis=hysteresis)
    scales = []
    for step in range(7):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean() * (float("inf") if step == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    first = 4.0 if hysteresis == 1 else 8.0  # hysteresis 2 keeps the scale through one overflow
    assert scales == [first, first, first, 2 * first, 2 * first, 2 * first, 4 * first]


def test_a_pickled_scaler_knows_its_growth_tracker_on_the_host():
    import pickle

    from lightning_amp_plus.syncs import HostSyncCounter

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    fused = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=5)
    scaler.scale(model(torch.ones(2, 4)).pow(2).mean()).backward()
    scaler.step(fused)
    scaler.update()  # decided on the device: the host lost the growth tracker
    clone = pickle.loads(pickle.dumps(scaler))  # pickling reads it (torch's own `__getstate__`)
    plain = torch.optim.SGD(model.parameters(), lr=0.01)
    with HostSyncCounter() as counter:
        plain.zero_grad()
        clone.scale(model(torch.ones(2, 4)).pow(2).mean()).backward()
        clone.step(plain)  # torch reads a non-fused step's flag: the one sync
        clone.update()  # and the clone reads nothing back
    assert counter.count == 1
    assert clone._get_growth_tracker() == 2


def test_small_behaviours_of_the_scaler_by_their_outcome():
    from lightning_amp_plus.scaler import _times

    off = DynamicLossScaler("cpu", enabled=False)
    assert off.scale_tensor() is None  # a disabled scaler has no scale, whatever it was given
    on = DynamicLossScaler("cpu", init_scale=8.0)
    on.scale(torch.ones(()))
    assert float(on.scale_tensor()) == 8.0
    on.set_device_type("xpu")  # a plugin learns its device from the trainer
    assert repr(on) == "DynamicLossScaler(device='xpu', init_scale=8.0)"
    with pytest.raises(TypeError, match=r"^`DynamicLossScaler.load_state_dict` expected a dict .*, got list\.$"):
        on.load_state_dict([])
    # a factor float32 cannot hold exactly: the product is rounded once, as torch's update kernel does (in double)
    assert _times(torch.tensor(3.0), 1.1).item() == torch.tensor(3.0 * 1.1, dtype=torch.float32).item()
    assert _times(torch.tensor(3.0), 1.1).item() != (torch.tensor(3.0) * 1.1).item()


def _clean_cycle(scaler, model, opt):
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_a_tracker_left_above_a_lowered_interval_grows_as_each_rule_says(hysteresis):
    """torch's kernel (hysteresis 1) grows only when the tracker reaches the interval exactly, so after
    `set_growth_interval` lowered it below the tracker the scale never grows again (as torch); the hysteresis rule
    grows at the next clean update."""
    model, opt = _setup()
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=5, hysteresis=hysteresis)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    twin, twin_opt = _setup()
    for _ in range(3):
        _clean_cycle(scaler, model, opt)
        _clean_cycle(torch_scaler, twin, twin_opt)
    scaler.set_growth_interval(2)
    torch_scaler.set_growth_interval(2)
    scales = []
    for _ in range(3):
        _clean_cycle(scaler, model, opt)
        _clean_cycle(torch_scaler, twin, twin_opt)
        scales.append((scaler.get_scale(), torch_scaler.get_scale()))
    if hysteresis == 1:
        assert scales == [(8.0, 8.0)] * 3
    else:
        assert [ours for ours, _ in scales] == [16.0, 16.0, 32.0]


def test_a_loaded_state_is_what_the_scaler_continues_from():
    """Every knob and tracker a state holds, at its bounds; what changed is said in one line; unknown keys and
    wrong types are named."""
    from lightning_amp_plus.syncs import HostSyncCounter

    source = DynamicLossScaler("cpu", init_scale=8.0, max_scale=1024.0, growth_interval=5)
    state = source.state_dict()
    state["_growth_tracker"] = 2**31 - 1  # the largest a tracker can hold
    model, opt = _setup()
    target = DynamicLossScaler("cpu", init_scale=64.0)
    _clean_cycle(target, model, opt)  # it ran before (its last update kept the scale)
    target.load_state_dict(state)
    assert target.knobs()["max_scale"] == 1024.0
    assert target.scale_kept is False  # the next update's scale is the loaded one, not "as before"
    with HostSyncCounter() as counter:
        _clean_cycle(target, model, opt)
    assert counter.count == 1  # the step's own flag read: the loaded tracker is known on the host
    with pytest.raises(AssertionError, match="^Attempted found_inf but _scale is None"):
        DynamicLossScaler("cpu").found_inf()
    with pytest.raises(ValueError, match=r"\(it has no keys\); expected a `GradScaler.state_dict\(\)`\.$"):
        DynamicLossScaler("cpu").load_state_dict({})
    with pytest.raises(ValueError, match=r"\(it has 'a', 'b'\); expected"):
        DynamicLossScaler("cpu").load_state_dict({"a": 1, "b": 2})
    with pytest.raises(TypeError, match=r"\(scale='8'\)` is invalid: expected a real number, got str\.$"):
        DynamicLossScaler("cpu").load_state_dict({**state, "scale": "8"})


def test_a_loaded_knob_change_is_said_in_one_line(caplog):
    caplog.set_level("INFO", logger="lightning_amp_plus")
    target = DynamicLossScaler("cpu", init_scale=8.0)
    target.load_state_dict(DynamicLossScaler("cpu", init_scale=8.0, growth_interval=7).state_dict())
    (line,) = [r.getMessage() for r in caplog.records if "replace" in r.getMessage()]
    assert line.endswith("the checkpoint's values replace this scaler's: growth_interval 2000 -> 7.")


def test_the_scaler_passes_every_argument_to_the_optimizer():
    model = torch.nn.Linear(2, 1)
    opt = Recording(model.parameters())
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert scaler.step(opt, None, "extra", key=1) == "stepped"
    assert opt.calls == [(False, ("extra",), {"key": 1})]


def test_a_callers_scale_is_kept_inside_the_bounds_and_ends_the_cycle():
    model, opt = _setup()
    scaler = DynamicLossScaler("cpu", init_scale=8.0, min_scale=2.0, max_scale=1024.0)
    with pytest.raises(AssertionError, match="^Attempted update but _scale is None"):
        scaler.update()
    _clean_cycle(scaler, model, opt)
    scaler.update(1e9)
    assert scaler.get_scale() == 1024.0
    scaler.update(0.5)
    assert scaler.get_scale() == 2.0
    with pytest.raises(AssertionError, match="^No inf checks were recorded"):  # no flag of an ended cycle is left
        scaler.found_inf()


def test_one_optimizers_flag_is_the_cycles_flag_with_no_device_op():
    from tests.test_cycle_rules import OpCounter

    model, opt = _setup()
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    with OpCounter() as counter:
        flag = scaler.found_inf()
    assert dict(counter.ops) == {}
    assert float(flag) == 0.0


def test_a_fused_step_gets_every_argument_too():
    class FusedRecording(Recording):
        def __init__(self, params):
            torch.optim.SGD.__init__(self, params, lr=0.1, fused=True)
            self.calls = []

    model = torch.nn.Linear(2, 1)
    opt = FusedRecording(model.parameters())
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt, None, "extra", key=1)
    assert opt.calls == [(False, ("extra",), {"key": 1})]


def test_the_sharded_scalers_default_device_is_cuda_off_where_there_is_none():
    """As torch's GradScaler: CUDA by default, turned off (with torch's warning) where CUDA is not available."""
    from lightning_amp_plus import ShardedDynamicLossScaler

    if torch.cuda.is_available():
        assert ShardedDynamicLossScaler().is_enabled()
    else:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not ShardedDynamicLossScaler().is_enabled()


def test_knobs_name_every_setting_in_force():
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=5, hysteresis=2)
    assert scaler.knobs() == {
        "init_scale": 8.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "hysteresis": 2,
    }


def test_asking_about_an_optimizer_it_never_saw_changes_nothing():
    from tests.test_cycle_rules import OpCounter

    ops = []
    for ask in (False, True):
        model, opt = _setup()
        scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=100)
        scaler.scale(model(torch.ones(1, 4)).pow(2).mean()).backward()
        scaler.step(opt)
        if ask:
            assert scaler.is_unscaled(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)) is False
        with OpCounter() as counter:
            scaler.update()
        ops.append(dict(counter.ops))
    assert ops[0] == ops[1]  # still the host's fast path: the stranger left no state behind


# ------------------------------------------------------------------ 0.3: what a reset forgets, what an update needs
def test_an_update_whose_cycle_never_stepped_raises_torchs_error_as_gradscaler_does():
    """scale, backward, update with the step forgotten: no inf check was recorded, and torch's message says so."""
    for scaler in (torch.amp.GradScaler("cpu", init_scale=8.0), DynamicLossScaler("cpu", init_scale=8.0)):
        model, opt = _setup()
        _clean_cycle(scaler, model, opt)  # a cycle first: the host knows the last update kept the scale
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 4)).pow(2).mean()).backward()
        with pytest.raises(AssertionError, match=r"^No inf checks were recorded prior to update\.$"):
            scaler.update()
        assert scaler.get_scale() == 8.0, type(scaler).__name__


def test_a_reset_forgets_the_last_updates_record():
    model, opt = _setup()
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    _clean_cycle(scaler, model, opt)
    assert scaler.last_update() is not None
    scaler.reset()
    assert scaler.last_update() is None  # a new run: no update yet, as before the first


def test_a_reset_starts_the_growth_tracker_at_zero_after_a_loaded_one():
    model, opt = _setup()
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=3)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 2})
    scaler.reset()
    assert scaler.state_dict()["_growth_tracker"] == 0
    scales = []
    for _ in range(3):
        _clean_cycle(scaler, model, opt)
        scales.append(scaler.get_scale())
    assert scales == [8.0, 8.0, 16.0]  # grown after exactly growth_interval clean updates of the new run


def test_from_grad_scaler_lets_the_callers_knobs_win_over_torchs_rule():
    made = DynamicLossScaler.from_grad_scaler(
        torch.amp.GradScaler("cpu", init_scale=2.0**10), min_scale=4.0, max_scale=2.0**12, hysteresis=3
    )
    assert made.knobs() == {
        "init_scale": 2.0**10,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "min_scale": 4.0,
        "max_scale": 2.0**12,
        "hysteresis": 3,
    }
    model, opt = _setup()
    _cycle(made, model, opt, torch.ones(1, 4), overflow=True)
    assert made.get_scale() == 2.0**10  # hysteresis 3: the first overflow keeps the scale


def test_from_grad_scaler_takes_torchs_own_knobs_as_given():
    """A GradScaler built with other factors and interval than torch's defaults: each one carried over, and used."""
    given = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    made = DynamicLossScaler.from_grad_scaler(given)
    assert {k: made.knobs()[k] for k in ("growth_factor", "backoff_factor", "growth_interval")} == {
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 1,
    }
    model, opt = _setup()
    _cycle(made, model, opt, torch.ones(1, 4), overflow=True)
    assert made.get_scale() == 2.0  # backed off by 0.25
    _cycle(made, model, opt, torch.ones(1, 4), overflow=False)
    assert made.get_scale() == 8.0  # grown by 4 after one clean update


def test_from_grad_scaler_refuses_a_disabled_scaler_by_name():
    with pytest.raises(
        ValueError, match=r"^`DynamicLossScaler.from_grad_scaler\(scaler\)` is invalid: the `GradScaler`"
    ):
        DynamicLossScaler.from_grad_scaler(torch.amp.GradScaler("cpu", enabled=False))


def test_a_used_grad_scaler_gives_a_scaler_whose_repr_and_reset_start_at_its_scale():
    """A GradScaler backed off 1024 -> 512: the scaler made from it starts a new run at 512, and says so."""
    model, opt = _setup()
    used = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    _cycle(used, model, opt, torch.ones(1, 4), overflow=True)
    assert used.get_scale() == 512.0
    made = DynamicLossScaler.from_grad_scaler(used)
    assert (
        repr(made)
        == "DynamicLossScaler(device='cpu', init_scale=512.0, growth_interval=3, min_scale=0.0, max_scale=inf)"
    )
    _cycle(made, model, opt, torch.ones(1, 4), overflow=True)
    made.reset()
    assert made.knobs()["init_scale"] == 512.0
    made.scale(torch.ones(()))
    assert made.get_scale() == 512.0
