"""Patterns from ordinary training code that once made a diagnostic change the run, raise, tell a false origin or hold
memory: each runs with every callback at its defaults, and the run is bit-identical to the run without them; the
watch names the later overflow, and the opt-in replay (`find_origin="replay"`) reads and runs each structure.

Found by a helper trying to break "diagnostics cannot hurt training" from outside: a teacher run under
`torch.inference_mode`, nested-tensor and dataclass batches, a scripted child, a dead weak proxy held as an attribute,
an EMA over a plain list of parameter pairs, a user's forward hook that counts, a compiled submodule moving a teacher,
an argument that is an expanded view, the logits of a model's output dict.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from collections import UserDict
from collections.abc import Mapping
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import (
    AmpAdvisor,
    AmpPlusPrecision,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)
from tests.helpers.trainer import make_trainer

LOUD = (2, 4)  # the batches whose first layer overflows float16: the first starts the watch, which names the second


def _all() -> list[Callback]:
    return [LossScaleMonitor(), NaNSkipReporter(), GradUnderflowMonitor(), PrecisionReport(), AmpAdvisor()]


def _fit(make_model, batches, callbacks: list[Callback], steps: int = 6, logs=None) -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = make_model()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    logger = CSVLogger(logs) if logs is not None else False
    make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=steps, log_every_n_steps=2, logger=logger).fit(
        model, loader
    )
    return {"model": model, "torch": torch.get_rng_state(), "skipped": plugin.history.skipped_steps}


def _assert_untouched(make_model, batches, logs, steps: int = 6) -> tuple[dict, list[Callback]]:
    plain = _fit(make_model, batches, [], steps, logs / "plain")
    callbacks = _all()
    watched = _fit(make_model, batches, callbacks, steps, logs / "watched")  # never raises
    pairs = zip(plain["model"].state_dict().items(), watched["model"].state_dict().items(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), name
    assert torch.equal(plain["torch"], watched["torch"])
    assert plain["skipped"] == watched["skipped"]
    return watched, callbacks


def _pairs(loud: bool = True, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        out.append((x * 1e5 if loud and i in LOUD else x, y))
    return out


def _origins(callbacks: list[Callback]) -> dict[int, dict]:
    (reporter,) = [c for c in callbacks if isinstance(c, NaNSkipReporter)]
    return {r["step"]: r["origin"] for r in reporter.skips}


def _replayed(make_model, batches, steps: int = 6) -> dict[int, dict]:
    """The origins the opt-in replay tells (watched from the start, each forward origin measured)."""
    reporter = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None)
    _fit(make_model, batches, [reporter], steps)
    return _origins([reporter])


# ---------------------------------------------------------------------------------------------- what the step holds
class _Distill(LightningModule):
    """The teacher runs under `torch.inference_mode()`: its output is an inference tensor, without a version."""

    def __init__(self):
        super().__init__()
        self.teacher = nn.Linear(8, 1).requires_grad_(False)
        self.student = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        with torch.inference_mode():
            target = self.teacher(x)
        return nn.functional.mse_loss(self.student(x).float(), target.clone().float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.1)


def test_a_teacher_under_inference_mode(tmp_path):
    watched, callbacks = _assert_untouched(_Distill, _pairs(), tmp_path)
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "teacher"  # the first to overflow (its output is the target)
    assert _replayed(_Distill, _pairs())[LOUD[0]]["float32"] == "finite"


class _Nested(LightningModule):
    """Variable-length sequences as a nested tensor, padded in the step."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        seqs, y = batch
        return nn.functional.mse_loss(self.head(self.fc(seqs.to_padded_tensor(0.0).mean(1))).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_nested_tensor_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(8):
        seqs = [torch.randn(n, 8, generator=g) * (1e5 if i in LOUD else 1.0) for n in (3, 5, 2, 4)]
        batches.append((torch.nested.nested_tensor(seqs), torch.randn(4, 1, generator=g)))
    watched, callbacks = _assert_untouched(_Nested, batches, tmp_path)
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "fc"
    assert _replayed(_Nested, batches)[LOUD[0]]["float32"] == "finite"


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Out:
    pred: torch.Tensor


class _DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, batch: _Batch) -> _Out:
        return _Out(pred=self.fc(batch.x))


class _Dataclasses(LightningModule):
    """Batches and outputs are dataclasses (as many codebases write them)."""

    def __init__(self):
        super().__init__()
        self.model = _DataclassNet()

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.model(batch).pred.float().mean(1, keepdim=True), batch.y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("fault", ["overflow", "nan in the batch"])
def test_dataclass_batches_and_outputs(fault, tmp_path):
    batches = [_Batch(x, y) for x, y in _pairs(loud=fault == "overflow")]
    if fault == "nan in the batch":
        for step in LOUD:
            batches[step].x[0, 0] = float("nan")  # a corrupt sample
    watched, callbacks = _assert_untouched(_Dataclasses, batches, tmp_path)
    assert watched["skipped"] == list(LOUD)
    told = _origins(callbacks)[LOUD[1]]
    if fault == "overflow":
        assert (told["phase"], told["module"]) == ("forward", "model.fc")
        assert _replayed(_Dataclasses, batches)[LOUD[0]]["float32"] == "finite"
    else:
        assert told == {"phase": "input"}  # the batch's NaN, found inside the dataclass


class _Pair(tuple):
    """(output, aux), built as `_Pair(out, aux)`: a tuple subclass whose `__new__` takes its fields, not an iterable."""

    def __new__(cls, out, aux):
        return super().__new__(cls, (out, aux))


class _PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        h = self.fc(x)
        return _Pair(h, h.float().pow(2).mean())


class _Pairs(LightningModule):
    def __init__(self):
        super().__init__()
        self.enc, self.head = _PairNet(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h, aux = self.enc(x)
        return nn.functional.mse_loss(self.head(h).float(), y) + 1e-3 * aux

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_tuple_subclass_output_is_held_and_replayed_without_rebuilding_it(tmp_path):
    watched, callbacks = _assert_untouched(_Pairs, _pairs(), tmp_path)  # once raised TypeError from _Pair.__new__
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "enc.fc"
    assert _replayed(_Pairs, _pairs())[LOUD[0]]["islands"] == ["enc.fc", "head"]  # its float32 output overflows next


class _Args(tuple):
    """An argument pair whose `__new__` takes its fields, the second optional: `_Args(x)` is `(x, None)`, so
    `_Args([x, gain])` builds a wrong pair instead of raising."""

    def __new__(cls, x, gain=None):
        return super().__new__(cls, (x, gain))


class _Gained(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, pair):
        assert isinstance(pair, _Args)  # the forward relies on its argument's type
        x, gain = pair
        return self.fc(x * gain)


class _ArgsModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.big, self.head = _Gained(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.big(_Args(x, torch.ones(8)))).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_tuple_subclass_argument_is_replayed_as_the_step_passed_it(tmp_path):
    watched, callbacks = _assert_untouched(_ArgsModel, _pairs(), tmp_path)
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "big.fc"
    told = _replayed(_ArgsModel, _pairs())[LOUD[0]]
    assert (told["module"], told["float32"], told["islands"][0]) == ("big.fc", "finite", "big.fc")  # not unknown


class _Encoding(UserDict):
    """A mapping that is no dict, as transformers' `BatchEncoding` (what tokenizers and collators return)."""


class _Namespaced(nn.Module):
    """A module that returns a plain result object."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return SimpleNamespace(hidden=self.fc(x))


class _Encoded(LightningModule):
    def __init__(self):
        super().__init__()
        self.big, self.head = _Namespaced(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.head(self.big(batch["x"]).hidden).float(), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("fault", ["overflow", "inf in the batch"])
def test_a_mapping_batch_and_a_namespace_output_are_read(fault, tmp_path):
    batches = [_Encoding(x=x, y=y) for x, y in _pairs(loud=fault == "overflow")]
    if fault == "inf in the batch":
        for step in LOUD:
            batches[step]["x"][0, 0] = float("inf")  # a corrupt sample inside the mapping
    watched, callbacks = _assert_untouched(_Encoded, batches, tmp_path)
    assert watched["skipped"] == list(LOUD)
    told = _origins(callbacks)[LOUD[1]]
    if fault == "overflow":  # inside the namespace the module returned: its output is read
        assert told["module"] == "big.fc"
        assert _replayed(_Encoded, batches)[LOUD[0]]["float32"] == "finite"
    else:  # inside the mapping: the batch's
        assert told == {"phase": "input"}


class _Store(Mapping):
    """A lazily loading store passed to a module: reading a value would load it (here it raises, as a closed file)."""

    def __len__(self):
        return 3

    def __iter__(self):
        return iter(range(3))

    def __getitem__(self, key):
        raise OSError("store closed")


class _Cyclic(nn.Module):
    """Returns a result object that refers to itself, and takes the store as an argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x, store):
        out = SimpleNamespace(hidden=self.fc(x))
        out.parent = out
        return out


class _Odd(LightningModule):
    def __init__(self):
        super().__init__()
        self.big, self.head, self.store = _Cyclic(), nn.Linear(16, 1), _Store()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.big(x, self.store).hidden).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_self_referring_result_and_a_store_that_cannot_be_read_change_nothing(tmp_path):
    watched, callbacks = _assert_untouched(_Odd, _pairs(), tmp_path)  # once RecursionError / OSError out of fit
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "big.fc"  # the namespace read two levels deep, not forever
    told = _replayed(_Odd, _pairs())[LOUD[0]]  # the store is an argument the replay copies, never reads
    assert (told["module"], told["float32"], told["islands"]) == ("big.fc", "finite", ["big.fc", "head"])


class _Scripted(LightningModule):
    def __init__(self):
        super().__init__()
        self.features = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))  # refuses hooks
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.features(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_scripted_child(tmp_path):
    watched, callbacks = _assert_untouched(_Scripted, _pairs(), tmp_path)
    assert watched["skipped"] == list(LOUD)
    (report,) = [c for c in callbacks if isinstance(c, PrecisionReport)]
    assert "features" not in [r["name"] for r in report.rows]  # not inspected (no hook), never raised


class _Owner:
    pass


class _DeadProxy(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)
        owner = _Owner()
        self.net.owner = weakref.proxy(owner)  # its referent is gone: touching it raises ReferenceError
        del owner

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_dead_weak_proxy_held_as_an_attribute(tmp_path):
    watched, _ = _assert_untouched(_DeadProxy, _pairs(), tmp_path)
    assert watched["skipped"] == list(LOUD)
    assert _replayed(_DeadProxy, _pairs())[LOUD[0]]["float32"] == "finite"


# ---------------------------------------------------------------------------------------------- what the code changes
HOOK_CALLS: list[float] = []  # a user's forward hook appends here (a global list)


class _EmaBody(nn.Module):
    def __init__(self, ema: nn.Module):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        # a plain list of (teacher, own) tuples
        self.pairs = list(zip(ema.parameters(), self.fc.parameters(), strict=True))

    def forward(self, x):
        with torch.no_grad():
            for t, s in self.pairs:
                t.data.mul_(0.9).add_(0.1 * s.data)  # the teacher moves through `.data`: no version counter moves
        return torch.relu(self.fc(x))


class _Ema(LightningModule):
    def __init__(self):
        super().__init__()
        self.ema = nn.Linear(8, 16).requires_grad_(False)
        self.body = _EmaBody(self.ema)
        self.body.owner = [self]  # a plain list holding the LightningModule: the replay reaches everything
        self.head = nn.Linear(16, 1)
        self.body.register_forward_hook(lambda m, a, o: HOOK_CALLS.append(float(o.float().nan_to_num().sum())))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.body(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_an_ema_over_a_list_of_pairs_and_a_counting_hook_see_the_step_only(tmp_path):
    HOOK_CALLS.clear()
    plain = _fit(_Ema, _pairs(), [], logs=tmp_path / "plain")
    plain_calls = list(HOOK_CALLS)
    HOOK_CALLS.clear()
    callbacks = _all()
    watched = _fit(_Ema, _pairs(), callbacks, logs=tmp_path / "watched")
    assert watched["skipped"] == plain["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "body.fc"  # watched
    assert torch.equal(watched["model"].ema.weight, plain["model"].ema.weight)  # the teacher moved once a step
    assert np.array_equal(HOOK_CALLS, plain_calls, equal_nan=True)  # the hook saw the steps' calls, no replay's


class _Attend(LightningModule):
    """Attention over an expanded view (one row shown three times) whose row 0 is all padding."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        seq = x.reshape(x.shape[0], 1, 8).expand(-1, 3, -1)  # an argument that cannot be written back in place
        padding = torch.zeros(x.shape[0], 3, dtype=torch.bool)
        padding[0] = True
        out, _ = self.attn(seq, seq, seq, key_padding_mask=padding)
        return nn.functional.mse_loss(self.head(out.mean(1)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_an_expanded_view_as_an_argument_is_replayed(tmp_path):
    watched, callbacks = _assert_untouched(_Attend, _pairs(loud=False), tmp_path, steps=3)
    assert watched["skipped"] == [0, 1, 2]
    assert _origins(callbacks)[1] == {"phase": "forward", "module": "attn", "kind": "nan"}  # watched
    told = _replayed(_Attend, _pairs(loud=False), steps=3)[0]
    assert told == {"phase": "forward", "module": "attn", "kind": "nan", "float32": "nonfinite"}


# ---------------------------------------------------------------------------------------------- memory
class _LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(8, 4096)

    def forward(self, x):
        logits = self.lm_head(x)
        return {"logits": logits, "loss": logits.float().pow(2).mean()}


class _Logits(LightningModule):
    """Its model returns a dict with large logits, as a language model does; the step keeps only the loss."""

    def __init__(self):
        super().__init__()
        self.model = _LanguageModel()
        self.freed: list[bool] = []
        self._logits: weakref.ref | None = None

    def training_step(self, batch, batch_idx):
        x, _ = batch
        out = self.model(x)
        self._logits = weakref.ref(out["logits"])
        return out["loss"]


class _Freed(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        gc.collect()
        pl_module.freed.append(pl_module._logits() is None)


def test_a_models_output_is_freed_as_without_the_reporter():
    model = _Logits()
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[NaNSkipReporter(), _Freed()], max_steps=3).fit(
        model, loader
    )
    assert model.freed == [True, True, True]  # the record holds the output dict weakly


# ---------------------------------------------------------------------------------------------- other ranks
def test_a_replay_cannot_take_part_in_a_collective(tmp_path):
    """A replay runs on one rank: a collective in the replayed code raises (told as the origin's reason) instead of
    waiting for ranks that never come, and collectives work again after it."""
    import torch.distributed as dist

    from lightning_amp_plus.forensics.opt_in.sandbox import sandboxed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = nn.Linear(2, 2)
        refused = r"cannot take part in a collective \(`all_reduce`\)"
        with pytest.raises(RuntimeError, match=refused), sandboxed([module], "cpu"):
            dist.all_reduce(torch.ones(1))
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
    finally:
        dist.destroy_process_group()


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.fc(x))


class _Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, out):
        return self.fc(out.last_hidden_state)


class _ModelOutputs(LightningModule):
    """A transformers ``ModelOutput`` handed from one module to the next (it refuses ``update`` and ``pop``)."""

    def __init__(self):
        super().__init__()
        self.enc, self.head = _Encoder(), _Reader()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.enc(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_transformers_model_output_between_modules_is_replayed(tmp_path):
    pytest.importorskip("transformers")
    watched, callbacks = _assert_untouched(_ModelOutputs, _pairs(), tmp_path)
    assert watched["skipped"] == list(LOUD)
    assert _origins(callbacks)[LOUD[1]]["module"] == "enc.fc"
    assert _replayed(_ModelOutputs, _pairs())[LOUD[0]]["float32"] == "finite"  # handed on, replayed


class _Noisy(nn.Module):
    """Draws from its own generator and appends to a list in forward; holds many plain objects besides."""

    def __init__(self, held):
        super().__init__()
        self.gen = torch.Generator().manual_seed(123)
        self.history = []
        self.fc = nn.Linear(8, 16)
        self.held = held  # set last: the walk meets it first

    def forward(self, x):
        self.history.append(len(self.history))
        return self.fc(x + torch.randn(x.shape, generator=self.gen) * 0.01)


class _Held(LightningModule):
    def __init__(self, held):
        super().__init__()
        self.noisy, self.head = _Noisy(held), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.noisy(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("held", ["strings", "objects"])
def test_a_module_holding_a_large_table_is_watched_and_replayed(held, tmp_path):
    table = [f"token{i}" for i in range(30_000)] if held == "strings" else [SimpleNamespace(i=i) for i in range(30_000)]
    watched, callbacks = _assert_untouched(lambda: _Held(table), _pairs(), tmp_path)  # nothing walked, nothing run
    assert watched["model"].noisy.history == list(range(6))
    assert _origins(callbacks)[LOUD[1]]["module"] == "noisy.fc"
    assert _replayed(lambda: _Held(table), _pairs())[LOUD[0]]["module"] == "noisy.fc"  # no walk to run out of
