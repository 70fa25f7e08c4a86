"""The watch on model code that bends the usual call order, each case a fit whose printed fix is measured.

Each case came from a break pass on real-world patterns: a call that raises (a caught fallback, checkpointing's
recompute stopped early), a float16 mask beside a real overflow, a batch the step changes in place, tensors whose
own code (``__torch_function__``) the watch must not run, broadcast inputs the watch must not copy.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, NaNSkipReporter
from tests.helpers.trainer import make_trainer

LOUD = (2, 5, 8)


def _loader(steps=10, scale=100.0, features=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 4, features, generator=g)
    for step in LOUD:
        x[step * 4 : step * 4 + 4] *= scale
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.01), batch_size=4)


def _fit(model, callbacks=(), steps=10, loader=None, **plugin):
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", **{"init_scale": 2.0**10, "growth_interval": 4, **plugin})
    make_trainer(plugins=[plugin], callbacks=list(callbacks), max_steps=steps).fit(model, loader or _loader(steps))
    return plugin


def _watched(make, loader=None):
    """The origins the default reporter told (from the second skip: the first starts the watch) and the advisor."""
    reporter, advisor = NaNSkipReporter(max_consecutive_skips=None, quiet=True), AmpAdvisor(print_advice=False)
    plugin = _fit(make(), [reporter, advisor], loader=loader)
    assert plugin.history.skipped_steps == list(LOUD)
    return [r["origin"] for r in reporter.skips][1:], advisor


def _pasted(advice):
    return eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})


# ------------------------------------------------------------------------------- a call that raises does end
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class _Checkpointed(LightningModule):
    """Manual optimization: a block under non-reentrant checkpointing (its recompute in backward stops early, by
    raising inside the block), then the own code overflows float16 and hands it to ``head``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.block, self.head = _Block(), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        h = checkpoint(self.block, x, use_reentrant=False)
        self.manual_backward(nn.functional.mse_loss(h.float(), x))
        z = h.detach() * 3000  # the own code: beyond float16 on the loud batches
        self.manual_backward(nn.functional.mse_loss(self.head(z * 1e-4).float(), y))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Fast(nn.Module):
    def forward(self, x):
        if x.dtype == torch.float16:
            raise RuntimeError("fast kernel: float16 not supported")
        return x


class _Fallback(LightningModule):
    """A fast path that raises, caught by the step (a flash-attention-style fallback); then the own code overflows."""

    def __init__(self):
        super().__init__()
        self.pre, self.fast, self.head = nn.Linear(8, 8), _Fast(), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.pre(x)
        try:
            h = self.fast(h)
        except RuntimeError:
            pass
        return nn.functional.mse_loss(self.head(h * 3000 * 1e-4).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("make", [_Checkpointed, _Fallback], ids=["checkpoint recompute", "caught fallback"])
def test_a_call_that_raised_is_not_blamed_for_what_the_own_code_made_later(make):
    origins, advisor = _watched(make)
    assert origins == [{"phase": "forward", "module": "", "kind": "inf"}] * 2  # the own code, no module
    assert "fp32_module" not in [a.code for a in advisor.advice]  # no island that cannot help


# ------------------------------------------------------------------------------- what the watch reads, and how
def _ops_of_watched_call(module, *args):
    """The aten ops a watched call of ``module`` dispatches beyond the plain call's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_amp_plus.forensics.observe import Watch

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    holder = nn.Module()
    holder.inner = module
    with Ops() as plain:
        holder.inner(*args)
    watch = Watch()
    watch.install(holder)
    watch.begin()
    with Ops() as watched:
        holder.inner(*args)
    watch.remove()
    extra = list(watched.names)
    for name in plain.names:
        extra.remove(name)
    return extra


class _Masked(nn.Module):
    def forward(self, x, mask):
        return x + mask


def test_a_broadcast_input_is_reduced_where_it_lies_not_copied():
    x = torch.randn(64, 32, 32)
    mask = torch.zeros(64, 1, 32).expand(64, 32, 32)  # a padding mask broadcast over the rows
    extra = _ops_of_watched_call(_Masked(), x, mask)
    assert not [op for op in extra if "copy" in op or "clone" in op or "contiguous" in op], extra


class _Dispatching(torch.Tensor):
    """A tensor whose ops run code of its own (``__torch_dispatch__``, as a quantized or sharded tensor's)."""

    seen: list = []

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data):
        self.data_ = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        unwrap = torch.utils._pytree.tree_map_only(cls, lambda t: t.data_, (args, kwargs or {}))
        return func(*unwrap[0], **unwrap[1])


def test_a_tensor_whose_ops_run_its_own_code_is_not_read():
    from lightning_amp_plus.forensics.observe import Watch

    holder = nn.Module()
    holder.inner = nn.Identity()
    watch = Watch()
    watch.install(holder)
    trace = watch.begin()
    x = _Dispatching(torch.randn(4, 8))
    _Dispatching.seen.clear()
    holder.inner(x)
    assert _Dispatching.seen == []  # nothing of its code ran for the watch
    assert trace == [(0, []), (-1, [])]  # the call is kept, its tensor unread
