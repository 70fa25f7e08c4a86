"""The one walk over a call's arguments (islands cast through it, PrecisionReport copies and reads through it)."""

from collections import namedtuple

import pytest
import torch

from lightning_amp_plus._tree import map_tensors, tensors

Pair = namedtuple("Pair", "a b")


def test_map_rebuilds_every_container_as_it_came_and_leaves_other_values():
    a, b, c = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    value = {"list": [a, "s"], "tuple": (b, 4), "pair": Pair(c, None), "none": None}
    out = map_tensors(lambda t: t * 10, value)
    assert list(out) == ["list", "tuple", "pair", "none"]
    assert type(out["list"]) is list
    assert type(out["tuple"]) is tuple
    assert type(out["pair"]) is Pair
    assert out["list"][1] == "s"
    assert out["tuple"][1] == 4
    assert out["pair"].b is None
    assert out["none"] is None
    assert [float(t) for t in tensors(out)] == [10.0, 20.0, 30.0]
    assert [float(t) for t in tensors(value)] == [1.0, 2.0, 3.0]  # the original untouched, in order


def test_the_reports_copy_keeps_requires_grad_and_its_dtype_reading_skips_integers():
    from lightning_amp_plus.callbacks.precision_report import _copied, _first_dtype

    w = torch.ones(2, requires_grad=True)
    copied = _copied(Pair(w, [torch.zeros(1)]))
    assert type(copied) is Pair
    assert copied.a.requires_grad
    assert copied.a is not w
    assert not copied.b[0].requires_grad
    assert _first_dtype({"ids": torch.ones(2, dtype=torch.long), "x": [torch.ones(1, dtype=torch.float16)]}) == (
        torch.float16
    )
    assert _first_dtype((torch.ones(1, dtype=torch.long), "x")) is None


def test_identity_by_type_tells_a_compiled_wrapper_and_unwraps_names():
    from lightning_amp_plus._identity import clean_name, is_compiled_wrapper

    plain = torch.nn.Linear(1, 1)
    compiled = torch.compile(plain, backend="eager")  # wrapping compiles nothing yet
    assert is_compiled_wrapper(compiled)
    assert not is_compiled_wrapper(plain)
    assert not is_compiled_wrapper(object())
    assert clean_name("net._orig_mod.0.weight") == "net.0.weight"


@pytest.mark.parametrize("key", ["RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"])
def test_only_rank_zero_speaks_whichever_launcher_set_the_rank(monkeypatch, caplog, key):
    from lightning_amp_plus._log import global_rank, say

    for other in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(other, raising=False)
    assert global_rank() == 0
    monkeypatch.setenv(key, "3")
    assert global_rank() == 3
    with caplog.at_level("WARNING", logger="lightning_amp_plus"):
        say("from rank three")
    assert "from rank three" not in caplog.text
    monkeypatch.setenv(key, "0")
    with caplog.at_level("WARNING", logger="lightning_amp_plus"):
        say("from rank zero")
    assert "from rank zero" in caplog.text
    monkeypatch.setenv(key, "x")  # not a number: ignored
    assert global_rank() == 0
