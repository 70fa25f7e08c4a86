"""A diagnostic watches and never touches: every callback, with its defaults, alone and all together, leaves the run
bit-identical to the run without it, on training steps with side effects, and never raises out of `fit`.

One model holds the patterns people write: a MoCo momentum encoder updated through `.data` in `training_step` and a
DINO-style teacher updated through `.data` inside a module's forward, an environment stepped in the step, augmentation
from the model's own `random.Random`, LayerDrop from a block's own `random.Random`, dropout, stochastic depth drawn
with `torch.rand` between modules, a key/value cache object made in a module's forward and appended to by its
attention, a replay buffer, a file written each step, a torchmetrics metric, `self.log`, and a hook on an activation.
Some batches overflow float16 in a module's forward and one loss is inf, so the runs skip and the replays run.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_amp_plus import (
    AmpPlusPrecision,
    NaNSkipReporter,
)
from tests.helpers.models import TinyModel, loud_batches
from tests.helpers.trainer import AT_DEFAULTS, make_trainer

STEPS = 16
#: batches whose inputs are so large that the first layer's float16 output overflows (a forward-born skip)
LOUD = (3, 9)
#: the step whose loss is multiplied by inf (a loss-born skip)
INF_LOSS = 6


class Environment:
    """An RL environment the step drives: a plain object with its own numpy generator and a step count."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.steps = 0

    def step(self) -> np.ndarray:
        self.steps += 1
        return self.rng.normal(size=4)


class Cache:
    """A key/value cache like transformers' `DynamicCache`: the attention appends to it, once per call."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        return torch.cat(self.keys, dim=1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.register_buffer("mask", torch.zeros(1, 1))  # sized for one key: a cache appended twice breaks it

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        keys = cache.update(x.unsqueeze(1))
        scores = (self.q(x).unsqueeze(1) * keys).sum(-1) / 4 + self.mask  # fails when the cache grew twice
        return x + (scores.softmax(-1).unsqueeze(-1) * keys).sum(1)


class Block(nn.Module):
    """A transformer-like block: it makes its cache in its forward, as transformers' models do."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.ff = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn(x, Cache()))


class LayerDrop(nn.Module):
    """Skips each layer with probability 0.3, drawn from its own `random.Random`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.rng = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.rng.random() < 0.3:
                continue
            x = torch.relu(layer(x))
        return x


class Teacher(nn.Module):
    """DINO-style: its forward moves the teacher towards the student in place through `.data`, then runs the student."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(8, 16)
        self.teacher = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s, t in zip(self.student.parameters(), self.teacher.parameters(), strict=True):
            t.data.mul_(0.99).add_(0.01 * s.data)  # in place through `.data`: no version counter moves
        return self.student(x) + 0.0 * self.teacher(x).detach()


class Busy(LightningModule):
    def __init__(self, log_file: str, manual: bool = False) -> None:
        super().__init__()
        self.encoder = Teacher()
        self.key_encoder = nn.Linear(8, 16)  # MoCo: moved through `.data` in training_step
        self.drop = nn.Dropout(0.1)
        self.layerdrop = LayerDrop()
        self.block = Block()
        self.head = nn.Linear(16, 1)
        self.metric = torchmetrics.MeanSquaredError()
        self.augment = random.Random(1)
        self.buffer: deque = deque(maxlen=8)
        self.environment = Environment()
        self.log_file = log_file
        self.automatic_optimization = not manual
        self.grads_seen: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + self.augment.uniform(-0.1, 0.1)
        self.buffer.append(self.environment.step())
        with open(self.log_file, "a") as f:
            f.write(f"{batch_idx}\n")
        h = self.drop(self.encoder(x))
        if torch.rand(()) < 0.5:  # stochastic depth, drawn between the modules
            h = h + self.key_encoder(x).detach()
        h = self.block(self.layerdrop(h))
        if h.requires_grad:
            h.register_hook(lambda g: self.grads_seen.append(float(g.float().abs().sum())) or g)
        out = self.head(h).float()
        loss = nn.functional.mse_loss(out, y)
        if batch_idx == INF_LOSS:
            loss = loss * float("inf")
        self.metric.update(out.detach(), y)
        self.log("train_loss", loss)
        with torch.no_grad():
            for q, k in zip(self.encoder.student.parameters(), self.key_encoder.parameters(), strict=True):
                k.data = 0.9 * k.data + 0.1 * q.data
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    return loud_batches(STEPS, LOUD, 3e4)  # the encoder's float16 output overflows


def _fit(tmp_path, name: str, callbacks: list, manual: bool = False) -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Busy(str(tmp_path / f"{name}.log"), manual=manual)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    trainer = make_trainer(
        plugins=[plugin], callbacks=callbacks, max_steps=STEPS, logger=CSVLogger(tmp_path / name), log_every_n_steps=4
    )
    trainer.fit(model, _loader())
    return {
        "model": model,
        "optimizer": trainer.optimizers[0].state_dict(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "lines": (tmp_path / f"{name}.log").read_text(),
        "skipped": plugin.history.skipped_steps,
    }


def _assert_identical(a: dict, b: dict) -> None:
    ma, mb = a["model"], b["model"]
    for (name, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(x, y), name  # weights, buffers, the teachers moved through `.data`
    for key, x in a["optimizer"]["state"].items():
        for field, value in x.items():
            assert torch.equal(value, b["optimizer"]["state"][key][field]), (key, field)
    assert torch.equal(a["torch"], b["torch"])
    assert a["python"] == b["python"]
    assert np.array_equal(a["numpy"], b["numpy"])
    assert ma.augment.getstate() == mb.augment.getstate()
    assert ma.layerdrop.rng.getstate() == mb.layerdrop.rng.getstate()
    assert ma.environment.steps == mb.environment.steps == STEPS  # stepped once a batch, never again
    assert ma.environment.rng.bit_generator.state == mb.environment.rng.bit_generator.state
    assert [list(o) for o in ma.buffer] == [list(o) for o in mb.buffer]
    assert a["lines"] == b["lines"]  # the file written once a step
    for key in ma.metric._defaults:  # the metric's states (torchmetrics 1.0 has no `metric_state`)
        value, other = getattr(ma.metric, key), getattr(mb.metric, key)
        assert torch.allclose(value, other, rtol=0, atol=0, equal_nan=True), key
    assert ma.metric._update_count == mb.metric._update_count
    assert np.array_equal(ma.grads_seen, mb.grads_seen, equal_nan=True)  # the user's hook: the real backward only
    assert a["skipped"] == b["skipped"]


CONFIGS = AT_DEFAULTS


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    path = tmp_path_factory.mktemp("baseline")
    return {manual: _fit(path, f"plain-{manual}", [], manual=manual) for manual in (False, True)}


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_callback_with_its_defaults_leaves_the_run_bit_identical(baseline, tmp_path, config, manual):
    plain = baseline[manual]
    assert len(plain["skipped"]) >= 3  # the loud batches and the inf loss were skipped: the replays had work
    watched = _fit(tmp_path, config, CONFIGS[config](), manual=manual)
    _assert_identical(watched, plain)


def test_the_origins_of_the_busy_run_are_named_right_and_their_fixes_help(tmp_path):
    reporter = NaNSkipReporter(max_consecutive_skips=None)
    _fit(tmp_path, "told", [reporter])
    by_step = {r["step"]: r["origin"] for r in reporter.skips}
    assert by_step[LOUD[0]]["reason"] == "every module is watched from the next step"  # read from the loss alone
    assert by_step[INF_LOSS] == {"phase": "loss"}  # watched: every module's output finite, the loss not
    assert by_step[LOUD[1]]["phase"] == "forward"

    def rerun(plugin, find_origin=True):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        again = NaNSkipReporter(max_consecutive_skips=None, find_origin=find_origin)
        make_trainer(plugins=[plugin], callbacks=[again], max_steps=STEPS).fit(
            Busy(str(tmp_path / "fixed.log")), _loader()
        )
        return {r["step"]: r["origin"] for r in again.skips}

    replayed = rerun(AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4), "replay")
    assert replayed[LOUD[1]]["module"] == by_step[LOUD[1]]["module"]  # the same observation, watched from the start
    islands, islanded = set(), []
    for step in LOUD:  # measured by the opt-in replay, which runs the module again (its contract)
        origin = replayed[step]
        assert origin["float32"] == "finite", origin
        if origin.get("islands"):
            islands.update(origin["islands"])
            islanded.append(step)
    assert islanded  # (the other one's float32 value overflows where no island a replay checks contains it)
    # the islands applied to the same run: no forward makes inf/nan there any more (these batches, 3e4 times the
    # others, then overflow in backward: another reading, told as such)
    fixed = rerun(AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4, fp32_modules=sorted(islands)))
    assert all(fixed.get(step, {}).get("phase") != "forward" for step in islanded), fixed
    # in bf16 float16's range is no limit: the inf loss is the one skip
    assert list(rerun(AmpPlusPrecision("bf16-mixed"))) == [INF_LOSS]


def test_the_sandbox_reaches_the_random_streams_the_model_holds():
    from lightning_amp_plus.forensics.opt_in.sandbox import streams

    model = Busy("unused.log")
    found = streams("cpu", model)
    for stream in (model.augment, model.layerdrop.rng):  # held as attributes of its modules
        assert any(s is stream for s in found)


def test_a_watched_model_pickles_and_a_copy_of_it_is_not_watched():
    """The user's own `torch.save(module)` and `copy.deepcopy(module)` (an EMA teacher) after the watch started."""
    import copy
    import io

    seen = {}

    class Saving(TinyModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 5:  # the watch started at step 3, after the NaN at step 2
                seen["watching"] = self.trainer.callbacks[0].origins.watching
                seen["hooked"] = [m for m in self.modules() if m._forward_hooks or m._forward_pre_hooks]
                torch.save(self.net, io.BytesIO())  # pickles
                teacher = copy.deepcopy(self.net)
                teacher(batch[0])
                seen["copy"] = [m._forward_hooks or m._forward_pre_hooks for m in teacher.modules()]

    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    model = Saving(poison={2: "nan"})
    make_trainer(plugins=[plugin], callbacks=[NaNSkipReporter(max_warnings=0)], max_steps=8).fit(model)
    assert seen["watching"]
    assert seen["hooked"] == []  # watched, and nothing of the watch on the modules
    assert not any(seen["copy"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # none left after fit
