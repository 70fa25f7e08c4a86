"""The one walk over a call's arguments (islands cast through it, PrecisionReport copies and reads through it)."""

import collections
import dataclasses
import types
from collections import UserDict, namedtuple

import pytest
import torch
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, NaNSkipReporter
from lightning_amp_plus.forensics._tree import map_tensors, tensors
from lightning_amp_plus.forensics.opt_in.sandbox import copied_inputs
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

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


# ------------------------------------------------------------------ the float32 recompute reads every container kind
@dataclasses.dataclass
class Box:
    x: torch.Tensor
    scale: float = 3e4


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    x: torch.Tensor
    scale: float = 3e4


class Encoding(UserDict):  # transformers' BatchEncoding is one
    def __getitem__(self, key):
        raise AssertionError("the walker must not call the user's code")


class TwoTuple(tuple):
    def __new__(cls, a, b=None):
        return super().__new__(cls, (a, b))


class Fields(collections.OrderedDict):  # a model output dict with its fields as attributes too
    pass


KINDS = {
    "dataclass": lambda h: Box(h),
    "frozen dataclass": lambda h: FrozenBox(h),
    "UserDict": lambda h: Encoding(x=h),
    "SimpleNamespace": lambda h: types.SimpleNamespace(x=h),
    "tuple subclass": lambda h: TwoTuple(h, "aux"),
    "named tuple": lambda h: collections.namedtuple("Named", "x aux")(h, None),
    "OrderedDict": lambda h: Fields(x=h),
}


def _x(packed):
    if isinstance(packed, (Box, FrozenBox, types.SimpleNamespace)):
        return packed.x
    if isinstance(packed, UserDict):
        return packed.data["x"]
    if isinstance(packed, dict):
        return packed["x"]
    return packed[0]


class Amplify(nn.Module):
    """Its float16 output overflows (3e4 * 4): finite recomputed in float32, whatever container its input came in."""

    def forward(self, packed):
        return _x(packed) * 3e4 * 4


class Packing(TinyModel):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.amp = Amplify()

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[0](x)  # float16 under autocast
        out = self.amp(KINDS[self.kind](h))
        return nn.functional.mse_loss(out.float().mean(1, keepdim=True), y)


@pytest.mark.parametrize("find_origin", [True, "replay"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_watch_and_the_replay_read_a_tensor_inside_every_container_kind(kind, find_origin):
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin=find_origin)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=2).fit(Packing(kind))
    assert len(reporter.skips) == 2, kind
    origin = reporter.skips[0 if find_origin == "replay" else 1]["origin"]  # watched: from the second on
    assert origin["phase"] == "forward", origin
    assert origin["module"] == "amp", origin  # its input read inside the container: finite; its output not
    if find_origin == "replay":
        assert origin["float32"] == "finite", origin  # the replay cast the tensor inside the container to float32


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_container_kind_is_walked_copied_and_rebuilt_without_the_users_code(kind):
    h = torch.ones(2, dtype=torch.float16)
    packed = KINDS[kind](h)
    assert [t is h for t in tensors(packed)] == [True]
    cast = map_tensors(lambda t: t.float(), packed)
    assert type(cast) is type(packed)
    assert _x(cast).dtype == torch.float32
    assert _x(packed).dtype == torch.float16  # the original as it was
    copied = copied_inputs(packed)
    assert _x(copied) is not h
    assert torch.equal(_x(copied), h)
    assert map_tensors(lambda t: t, packed) is packed  # nothing changed: the very value


@dataclasses.dataclass(frozen=True, slots=True)
class _Slotted:
    x: torch.Tensor
    tag: str = "t"


class _SlottedPlus(_Slotted):
    __slots__ = ("cache",)  # a slot that is no field


class _Mirrored(collections.OrderedDict):
    """A dict whose items are mirrored as attributes (as a transformers ``ModelOutput``'s are)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


class _Tagged(tuple):
    pass


def test_a_rebuilt_container_keeps_its_slots_factory_attributes_and_mirrors():
    t = torch.tensor(1.0)
    plus = _SlottedPlus(t, "kept")
    object.__setattr__(plus, "cache", "c")
    slotted = map_tensors(lambda v: v * 2, plus)
    assert (type(slotted), float(slotted.x), slotted.tag, slotted.cache) == (_SlottedPlus, 2.0, "kept", "c")
    counts = map_tensors(lambda v: v * 2, collections.defaultdict(list, {"a": t}))
    assert counts.default_factory is list  # its factory kept: a later missing key still works
    mirrored = _Mirrored()
    mirrored["x"] = t
    made = map_tensors(lambda v: v * 2, mirrored)
    assert float(made["x"]) == 2.0
    assert float(made.x) == 2.0  # the attribute follows the item, as the class keeps them
    tagged = _Tagged((t,))
    tagged.note = "n"
    again = map_tensors(lambda v: v * 2, tagged)
    assert (type(again), again.note, float(again[0])) == (_Tagged, "n", 2.0)
