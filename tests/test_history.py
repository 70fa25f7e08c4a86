import io
import pickle

import pytest
import torch

from lightning_amp_plus import ScaleHistory


def test_change_points_and_skips():
    history = ScaleHistory(capacity=4)
    seq = [(8.0, 0), (8.0, 1), (4.0, 0), (4.0, 0), (4.0, 0), (8.0, 0), (8.0, 1), (4.0, 1), (2.0, 0)]
    for step, (scale, found) in enumerate(seq):
        history.record(step, torch.tensor(scale), torch.tensor(float(found)))
    assert history.curve() == [(0, 8.0), (2, 4.0), (5, 8.0), (7, 4.0), (8, 2.0)]
    assert history.skipped_steps == [1, 6, 7]
    assert history.num_skipped == 3
    assert history.num_steps == 9
    assert [history.scale_at(s) for s in range(9)] == [s for s, _ in seq]
    assert history.skipped_between(2, 7) == [6, 7]


def test_buffer_flushes_in_one_transfer_per_capacity():
    history = ScaleHistory(capacity=3)
    for step in range(5):
        history.record(step, torch.tensor(2.0), torch.tensor(0.0))
    assert history.pending == 2  # 3 were flushed automatically when the buffer filled
    assert history.curve() == [(0, 2.0)]
    assert history.pending == 0


def test_by_default_it_holds_256_device_records_and_plain_numbers_are_taken_at_once():
    """256: the README's "every 256 steps" for a run whose outcomes stay on the device."""
    history = ScaleHistory()
    assert history.scaled is True
    for step in range(255):
        history.record(step, torch.tensor(2.0), torch.tensor(0.0))
    assert history.pending == 255
    history.record(255, torch.tensor(2.0), torch.tensor(0.0))
    assert history.pending == 0  # full: moved to the host in one transfer
    history.record(256, 2.0, 0.0)
    assert history.pending == 0  # numbers the host knows cost nothing to keep
    history.record(257, 2.0, torch.tensor(1.0))
    history.record(258, 4.0, 0.0)  # queued behind the pending record, to keep the order
    assert history.pending == 2
    assert history.skipped_steps == [257]
    one = ScaleHistory(capacity=1)  # the smallest buffer: every device record is moved at once
    one.record(0, torch.tensor(2.0), torch.tensor(0.0))
    assert one.pending == 0


def test_a_flag_of_any_dtype_is_a_flag():
    history = ScaleHistory()
    history.record(0, torch.tensor(8.0), torch.tensor(True))
    history.record(1, torch.tensor(4.0, dtype=torch.float16), torch.tensor(0, dtype=torch.int32))
    assert history.skipped_steps == [0]
    assert history.curve() == [(0, 8.0), (1, 4.0)]


def test_a_scale_of_none_needs_a_scale_before_it():
    with pytest.raises(ValueError, match=r"^`ScaleHistory.record\(step=0, scale=None\)` is invalid: no scale recorded"):
        ScaleHistory().record(0, None, 0.0)


def test_steps_must_increase_and_queries_are_bounded():
    history = ScaleHistory()
    history.record(5, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"ScaleHistory.record\(step=5\)` is invalid: steps must increase"):
        history.record(5, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"scale_at\(step=4\)` is invalid: the history covers steps 5 to 5"):
        history.scale_at(4)
    with pytest.raises(ValueError, match=r"`ScaleHistory\(capacity=0\)` is invalid"):
        ScaleHistory(capacity=0)


def test_size_is_bounded_by_events_not_steps():
    history = ScaleHistory()
    scale = torch.tensor(65536.0)
    clean = torch.tensor(0.0)
    for step in range(3000):
        history.record(step, scale, clean)
    buf = io.BytesIO()
    torch.save(history.state_dict(), buf)
    assert len(pickle.dumps(history.state_dict())) < 400
    assert buf.tell() < 1500  # torch.save's zip container adds fixed overhead
    assert history.curve() == [(0, 65536.0)]


def test_state_dict_round_trip_and_csv(tmp_path):
    history = ScaleHistory()
    for step, (scale, found) in enumerate([(4.0, 1), (2.0, 0), (2.0, 0)]):
        history.record(step * 2, scale, found)
    clone = ScaleHistory()
    clone.load_state_dict(history.state_dict())
    assert clone.curve() == history.curve()
    assert clone.skipped_steps == [0]
    clone.record(6, 2.0, 0.0)  # continues after the loaded steps, no spurious change point
    assert clone.curve() == [(0, 4.0), (2, 2.0)]
    path = tmp_path / "h.csv"
    history.to_csv(path)
    assert path.read_text().splitlines() == ["step,scale,skipped", "0,4.0,1", "2,2.0,0", "4,2.0,0"]  # to the last
    with pytest.raises(ValueError, match="version"):
        clone.load_state_dict({"version": 99})


def test_load_state_dict_restores_every_field_and_recording_continues():
    source = ScaleHistory()
    for step, (scale, found) in enumerate([(8.0, 0), (8.0, 1), (4.0, 1), (2.0, 0)]):
        source.record(step, torch.tensor(scale), torch.tensor(float(found)))
    loaded = ScaleHistory()
    loaded.load_state_dict(source.state_dict())
    assert loaded.last_step == source.last_step == 3
    assert loaded.num_steps == 4
    assert loaded.trailing_skips == 0  # the last step was clean
    assert loaded.curve() == source.curve()
    with pytest.raises(ValueError, match="steps must increase"):
        loaded.record(3, torch.tensor(2.0), torch.tensor(0.0))  # the restored last step still guards order
    loaded.record(4, torch.tensor(2.0), torch.tensor(0.0))
    assert loaded.curve() == [(0, 8.0), (2, 4.0), (3, 2.0)]  # no spurious change point at the resume


def _history_state(**changes):
    history = ScaleHistory()
    for step, found in enumerate([0, 1, 0]):
        history.record(step, torch.tensor(4.0), torch.tensor(float(found)))
    state = history.state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"skipped_steps": [1, 1]}, r"\['skipped_steps'\]=\[1, 1\]` is invalid: expected increasing ints"),
        ({"skipped_steps": [-1]}, r"\['skipped_steps'\]=\[-1\]` is invalid"),
        ({"change_steps": [True]}, r"\['change_steps'\]=\[True\]` is invalid"),
        ({"change_scales": [4.0, 2.0]}, r"\['change_scales'\]=\[4.0, 2.0\]` is invalid: .*one per change step"),
        ({"num_steps": True}, r"\['num_steps'\]=True` is invalid"),
        ({"last_step": 0}, r"\['last_step'\]=0` is invalid: expected an int >= every recorded step"),
        ({"last_step": None}, r"\['last_step'\]=None` is invalid with num_steps=3"),
        ({"last_step": True}, r"\['last_step'\]=True` is invalid"),
    ],
)
def test_invalid_history_states_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        ScaleHistory().load_state_dict(_history_state(**changes))


def test_an_empty_history_state_loads():
    loaded = ScaleHistory()
    loaded.load_state_dict(ScaleHistory().state_dict())
    assert loaded.last_step is None
    assert loaded.num_steps == 0


def test_last_flag_is_the_last_records_own_outcome():
    history = ScaleHistory()
    assert history.last_flag() is None
    history.record(0, 8.0, 0.0)
    assert history.last_flag() == (0, 0.0)
    history.record(1, 8.0, 1.0)
    assert history.last_flag() == (1, 1.0)
    history.record(4, 4.0, 0.0)  # skipped before, clean now
    assert history.last_flag() == (4, 0.0)
    history.record(5, 4.0, 1.0)
    history.record(6, 2.0, 1.0)
    assert history.last_flag() == (6, 1.0)
    flag = torch.tensor(1.0)
    history.record(7, torch.tensor(2.0), flag)  # pending on the device: handed back as it is, not read
    step, pending = history.last_flag()
    assert step == 7
    assert pending is flag


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"skip_streaks": [1, 1]}, r"^`ckpt\['skip_streaks'\]=\[1, 1\]` is invalid: expected an int >= 1 per skipped"),
        ({"skip_streaks": [0]}, r"^`ckpt\['skip_streaks'\]=\[0\]` is invalid"),
        ({"skip_streaks": [True]}, r"^`ckpt\['skip_streaks'\]=\[True\]` is invalid"),
        (
            {"trailing_skips": 2},
            r"^`ckpt\['trailing_skips'\]=2` is invalid: expected 0 or the last skip's streak \(1\)\.$",
        ),
        ({"trailing_skips": True}, r"^`ckpt\['trailing_skips'\]=True` is invalid"),
        (
            {"skipped_steps": [], "skip_streaks": [], "num_steps": 3, "trailing_skips": 1},
            r"^`ckpt\['trailing_skips'\]=1` is invalid: expected 0 or the last skip's streak \(0\)\.$",
        ),
        ({"scaled": "yes"}, r"^`ckpt\['scaled'\]='yes'` is invalid: expected True or False\.$"),
        ({"version": 3}, r"^`ckpt\['version'\]=3` is invalid: expected 1 or 2\.$"),
        ({"change_steps": [True]}, r"^`ckpt\['change_steps'\]=\[True\]` is invalid"),
        ({"skipped_steps": [1, 1]}, r"^`ckpt\['skipped_steps'\]=\[1, 1\]` is invalid"),
    ],
)
def test_invalid_history_states_name_where_they_came_from(changes, match):
    with pytest.raises(ValueError, match=match):
        ScaleHistory().load_state_dict(_history_state(**changes), where="ckpt")


def test_history_states_of_every_kind_load():
    with pytest.raises(TypeError, match=r"^`ScaleHistory.load_state_dict` is invalid: expected a dict, got list\.$"):
        ScaleHistory().load_state_dict([])
    old = _history_state(version=1)  # 0.1.x: no streaks, no `scaled`: each skip its own streak, a scaled run
    for key in ("skip_streaks", "trailing_skips", "scaled"):
        old.pop(key)
    loaded = ScaleHistory(scaled=False)
    loaded.load_state_dict(old)
    assert loaded.scaled is True
    assert loaded.skipped_steps == [1]
    assert loaded.streak_at(1) == 1
    assert loaded.trailing_skips == 0
    clean = _history_state(change_steps=[], change_scales=[], skipped_steps=[], skip_streaks=[], num_steps=1)
    clean["last_step"] = 0  # one clean update and no change point: every recorded step (none) is <= 0
    loaded.load_state_dict(clean)
    assert loaded.last_step == 0
    assert loaded.num_steps == 1


def test_queries_at_their_edges():
    history = ScaleHistory()
    with pytest.raises(
        ValueError,
        match=r"^`ScaleHistory.scale_at\(step=0\)` is invalid: the history covers steps"
        r" None to None\.$",
    ):
        history.scale_at(0)
    for step, (scale, found) in enumerate([(8.0, 0.0), (8.0, 1.0), (4.0, 1.0), (2.0, 0.0)]):
        history.record(step, scale, found)
    assert [history.scale_at(s) for s in range(4)] == [8.0, 8.0, 4.0, 2.0]
    first = ScaleHistory()
    first.record(0, 8.0, 0.0)
    with pytest.raises(ValueError, match=r"covers steps 0 to 0\.$"):
        first.scale_at(1)
    with pytest.raises(ValueError, match=r"covers steps 0 to 3\.$"):
        history.scale_at(4)
    assert history.skipped_between(1, 2) == [1, 2]  # both ends included
    assert history.skipped_between(2, 3) == [2]
    assert history.streak_at(2) == 2
    for clean in (0, 3, 9):  # before, between and after the skips
        with pytest.raises(
            ValueError, match=rf"^`ScaleHistory.streak_at\(step={clean}\)` is invalid: step {clean} was"
        ):
            history.streak_at(clean)


@pytest.mark.parametrize("scales", [[True], [0.0], [-1.0], [float("inf")], ["8"]])
def test_saved_scales_must_be_finite_positive_numbers(scales):
    with pytest.raises(ValueError, match=r"\['change_scales'\]=.* is invalid: expected a list of finite numbers > 0"):
        ScaleHistory().load_state_dict(_history_state(change_scales=scales))


def test_a_saved_scale_of_one_loads():
    loaded = ScaleHistory()
    loaded.load_state_dict(_history_state(change_scales=[1.0]))
    assert loaded.curve() == [(0, 1.0)]
    assert loaded.trailing_skips == 0


def test_repr_of_a_class_with_nothing_given():
    from lightning_amp_plus._repr import KnobsRepr

    class Plain(KnobsRepr):
        pass

    class Given(KnobsRepr):
        def __init__(self):
            self._given = {"a": 1, "b": "x"}

    assert repr(Plain()) == "Plain()"
    assert repr(Given()) == "Given(a=1, b='x')"
