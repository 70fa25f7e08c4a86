"""Nothing the user wrote runs a second time unless asked for by name: by construction, not by a list of state kinds.

Forward passes that keep state outside their tensors, each a pattern from real code: a module-level list appended
through a helper function (MegaBlocks' load-balancing statistics, read and cleared by `training_step`, which raises if
it holds more than the step made), a numpy counter written in place (a VQ-VAE's code usage), a counter in C memory
(`ctypes`), an iterator advanced, a file appended to, a `functools.lru_cache`, and a compiled block that keeps a
count through a helper. Some batches overflow float16 in the first layer (forward-born skips). Every callback at its
defaults, alone and together: weights, optimizer state, random streams and every one of those objects bit for bit as
without them, and `fit` ends as it does without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import random

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from lightning_amp_plus import (
    AmpPlusPrecision,
    NaNSkipReporter,
)
from tests.helpers.models import loud_batches
from tests.helpers.trainer import AT_DEFAULTS, make_trainer

STEPS = 12
LOUD = (2, 5, 8)  # batches whose first layer overflows float16: forward-born skips

#: MegaBlocks-style: the experts append their load statistics here; the step reads and clears it
LOAD_STATS: list[float] = []
#: a compiled block's calls, counted through a helper
BLOCK_CALLS: list[int] = []
#: what the user's tensor code saw: a tensor subclass's and a mode's `__torch_function__`, a dict's `__getitem__`
USER_CALLS: list[str] = []


class Counted(torch.Tensor):
    """A tensor subclass that logs every op it takes part in (a metadata-carrying or logging tensor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        USER_CALLS.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class CountMode(TorchFunctionMode):
    """A mode the step runs under that logs every op (an op logger or counter)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        USER_CALLS.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class Logged(dict):
    """A result dict that logs which keys were read."""

    def __getitem__(self, key):
        USER_CALLS.append(f"read {key}")
        return dict.__getitem__(self, key)


def _record_load(value: float) -> None:
    LOAD_STATS.append(value)  # the forward names no global: the helper does


def _count_block_call() -> None:
    BLOCK_CALLS.append(1)


@functools.cache
def _scale_for(width: int) -> float:
    return 1.0 / width


def _cached_calls() -> int:
    info = _scale_for.cache_info()
    return info.hits + info.misses


#: each pattern of state outside the tensors, tested alone (one cannot hide another)
PATTERNS = (
    "module-level list",
    "numpy array",
    "ctypes counter",
    "iterator",
    "file",
    "lru_cache",
    "compiled block",
    "tensor subclass",
    "function mode",
    "dict subclass",
)


class Expert(nn.Module):
    def __init__(self, pattern: str, log_path: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(8, 16)
        self.usage = np.zeros(4)  # code usage, written in place
        self.calls = ctypes.c_long(0)  # a counter in C memory
        self.ticks = itertools.count()  # an iterator advanced once a call
        self.log_path = log_path  # a file appended to once a call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.pattern == "module-level list":
            _record_load(float(h.detach().float().abs().mean()))
        elif self.pattern == "numpy array":
            self.usage[int(h.detach().argmax()) % 4] += 1
        elif self.pattern == "ctypes counter":
            self.calls.value += 1
        elif self.pattern == "iterator":
            next(self.ticks)
        elif self.pattern == "file":
            with open(self.log_path, "a") as f:
                f.write(f"{float(h.detach().float().sum())}\n")
        elif self.pattern == "lru_cache":
            h = h * _scale_for(h.shape[-1]) * 16
        elif self.pattern == "tensor subclass":
            h = h.as_subclass(Counted)
        elif self.pattern == "dict subclass":
            return Logged(h=h)
        return h


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _count_block_call()
        return torch.relu(self.fc(x))


class Stateful(LightningModule):
    def __init__(self, pattern: str, log_path: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.expert = Expert(pattern, log_path)
        self.block = torch.compile(Block(), backend="eager") if pattern == "compiled block" else Block()
        self.head = nn.Linear(16, 1)
        self.loads: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        with CountMode() if self.pattern == "function mode" else contextlib.nullcontext():
            h = self.expert(x)
            out = self.head(self.block(h["h"] if self.pattern == "dict subclass" else h)).float()
        out = out.as_subclass(torch.Tensor)
        if self.pattern == "module-level list":
            loads = list(LOAD_STATS)
            LOAD_STATS.clear()
            if len(loads) != 1:  # the user's own check: one statistic per forward
                raise ValueError(f"expected one load statistic from this step, got {len(loads)}")
            self.loads += loads
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    return loud_batches(STEPS, LOUD, 1e5)  # beyond float16: the expert's input cast overflows


def _fit(tmp_path, name: str, callbacks: list, pattern: str = "module-level list") -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    LOAD_STATS.clear()
    USER_CALLS.clear()
    calls_before, cached_before = len(BLOCK_CALLS), _cached_calls()
    log = tmp_path / f"{name}.log"
    log.write_text("")
    model = Stateful(pattern, str(log))
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    trainer = make_trainer(
        plugins=[plugin], callbacks=callbacks, max_steps=STEPS, logger=CSVLogger(tmp_path / name), log_every_n_steps=3
    )
    trainer.fit(model, _loader())
    objects = {
        "module-level list": repr(model.loads),  # nan included
        "numpy array": model.expert.usage.tolist(),
        "ctypes counter": model.expert.calls.value,
        "iterator": repr(model.expert.ticks),
        "file": log.read_text(),
        "lru_cache": _cached_calls() - cached_before,
        "compiled block": len(BLOCK_CALLS) - calls_before,
        "tensor subclass": list(USER_CALLS),
        "function mode": list(USER_CALLS),
        "dict subclass": list(USER_CALLS),
    }
    return {
        "model": model,
        "optimizer": trainer.optimizers[0].state_dict(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
        "object": objects[pattern],
        "skipped": plugin.history.skipped_steps,
    }


CONFIGS = AT_DEFAULTS


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("plain")
    return {pattern: _fit(path, f"plain-{i}", [], pattern) for i, pattern in enumerate(PATTERNS)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_state_outside_the_tensors_is_left_as_without_the_callbacks(plain, tmp_path, pattern, config):
    before = plain[pattern]
    assert len(before["skipped"]) >= 2  # forward-born skips: the watch was on for the later ones
    watched = _fit(tmp_path, config, CONFIGS[config](), pattern)  # the fit ends as the plain one did
    for (name, x), (_, y) in zip(
        before["model"].state_dict().items(), watched["model"].state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
    for key, state in before["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, watched["optimizer"]["state"][key][field]), (key, field)
    assert torch.equal(before["rng"][0], watched["rng"][0])
    assert before["rng"][1] == watched["rng"][1]
    assert np.array_equal(before["rng"][2], watched["rng"][2])
    assert watched["object"] == before["object"], pattern
    assert watched["skipped"] == before["skipped"]


def test_the_watch_names_the_module_of_the_later_forward_born_skips(tmp_path):
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    run = _fit(tmp_path, "named", [reporter])
    origins = {r["step"]: r["origin"] for r in reporter.skips}
    forward = [s for s in run["skipped"] if origins[s]["phase"] == "forward"]
    assert len(forward) >= 2
    first, *later = forward
    assert "module" not in origins[first]  # read from the loss: nothing was watched yet, and it says so
    assert origins[first]["reason"] == "every module is watched from the next step"
    assert all(origins[s]["module"] == "expert.fc" for s in later)  # the float16 overflow, named by watching


def test_the_opt_in_replay_runs_the_module_again_as_its_contract_says(tmp_path):
    """Asked for by name, the replay runs the module's code again: parameters, buffers and random streams are put
    back, and the rest happens again (here the user's own check then fails the fit, as the docs say it may)."""
    with pytest.raises(ValueError, match="expected one load statistic"):
        _fit(tmp_path, "replayed", [NaNSkipReporter(find_origin="replay")])
