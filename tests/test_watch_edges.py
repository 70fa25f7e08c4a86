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
from tests.helpers.models import loud_batches
from tests.helpers.trainer import make_trainer

LOUD = (2, 5, 8)


def _loader(steps=10, scale=100.0):
    return loud_batches(steps, LOUD, scale)


def _fit(model, callbacks=(), steps=10, loader=None, plugin=None, **knobs):
    torch.manual_seed(0)
    plugin = plugin or AmpPlusPrecision("16-mixed", **{"init_scale": 2.0**10, "growth_interval": 4, **knobs})
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
        try:  # noqa: SIM105 - the fallback as users write it
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
    watch.remove()
    assert _Dispatching.seen == []  # nothing of its code ran for the watch
    assert trace == [(0, []), (-1, [])]  # the call is kept, its tensor unread


# ------------------------------------------------------------------------------- a float16 mask beside an overflow
T = 6


class _Bias(nn.Module):
    """A learned relative-position bias made causal with ``-inf`` under autocast: float16 ``-inf`` by design."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1, 1)
        self.register_buffer("rel", (torch.arange(T)[None, :] - torch.arange(T)[:, None]).float()[..., None] / T)

    def forward(self):
        b = self.proj(self.rel)[..., 0]
        return b.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, bias):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # beyond float16 on the loud batches: its own overflow
        return torch.softmax(scores + bias, -1) @ self.v(x / x.norm(dim=-1, keepdim=True))


class _BiasedAttention(LightningModule):
    def __init__(self):
        super().__init__()
        self.bias, self.attn, self.head = _Bias(), _Attention(), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.attn(x.view(-1, T, 8), self.bias())).float().mean(1)
        return nn.functional.mse_loss(out, y.view(-1, T).mean(1, keepdim=True))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _sequences(steps=10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 2 * T, 8, generator=g)
    for step in LOUD:
        x[step * 2 * T : (step + 1) * 2 * T] *= 300.0
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.01), batch_size=2 * T)


def test_a_float16_mask_is_no_overflow_the_call_that_took_it_and_overflowed_is_named():
    origins, advisor = _watched(_BiasedAttention, _sequences())
    assert origins == [{"phase": "forward", "module": "attn", "kind": "nan", "fed_by": "bias"}] * 2
    (advice,) = [a for a in advisor.advice if a.code == "fp32_module"]
    assert advice.evidence["islands"] == ["attn", "bias"]  # a watch cannot tell a mask from an overflow to -inf
    assert _fit(_BiasedAttention(), loader=_sequences(), plugin=_pasted(advice)).history.num_skipped == 0
    assert _fit(_BiasedAttention(), loader=_sequences(), fp32_modules=["attn"]).history.num_skipped == 0
    assert _fit(_BiasedAttention(), loader=_sequences(), fp32_modules=["bias"]).history.skipped_steps == list(LOUD)
    replayed = NaNSkipReporter(find_origin="replay", max_consecutive_skips=None, quiet=True)
    _fit(_BiasedAttention(), [replayed], loader=_sequences())
    assert [(r["origin"]["float32"], r["origin"]["islands"]) for r in replayed.skips] == [("finite", ["attn"])] * 3


def test_the_skip_line_says_where_the_float16_minus_inf_came_from():
    from lightning_amp_plus.callbacks._skip_text import describe_origin

    told = {"phase": "forward", "module": "attn", "kind": "nan", "fed_by": "bias"}
    assert describe_origin(told) == "born in forward of attn (nan; it took a float16 -inf from bias)"


# ------------------------------------------------------------------------------- a batch the step changes in place
class _Standardized(LightningModule):
    """The step standardizes its batch in place; a batch with a constant feature makes 0/0 in that own code."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        self.loaded_finite = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.loaded_finite.append(bool(torch.isfinite(x).all()))
        x.sub_(x.mean(0)).div_(x.std(0))
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _constant_feature(steps=10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 4, 8, generator=g)
    for step in LOUD:
        x[step * 4 : step * 4 + 4, 3] = 1.0
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.01), batch_size=4)


def test_a_batch_the_step_changed_in_place_is_not_blamed_and_a_rerun_starts_from_it_as_loaded():
    model = _Standardized()
    reporter, advisor = NaNSkipReporter(max_consecutive_skips=None, quiet=True), AmpAdvisor(print_advice=False)
    plugin = _fit(model, [reporter, advisor], loader=_constant_feature())
    assert plugin.history.skipped_steps == list(LOUD)
    assert all(model.loaded_finite)
    assert [r["origin"]["phase"] for r in reporter.skips] == ["forward"] * 3  # never "input": the data was finite
    assert [r["origin"].get("module") for r in reporter.skips][1:] == [""] * 2  # the own code
    (advice,) = advisor.advice
    assert advice.code == "own_code"
    reporter = eval(advice.fix.split("  #")[0], {"NaNSkipReporter": NaNSkipReporter})  # pasted as printed
    _fit(_Standardized(), [reporter], loader=_constant_feature())
    told = [r["origin"] for r in reporter.skips]
    assert [o.get("float32") for o in told][1:] == ["nonfinite"] * 2  # 0/0 in any precision, rerun as loaded


class _Exponentiated(_Standardized):
    """The step exponentiates its batch in place, then its own matmul overflows float16 (not float32) on batches with
    a feature at 10: ``exp(10) * 4``. A rerun on the batch as the step left it would take ``exp(exp(10))``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x.exp_()
        h = x @ torch.full((8, 8), 4.0, device=x.device)  # float16 under autocast
        return nn.functional.mse_loss(self.b(torch.relu(self.a(h))).float(), y)


def _feature_at_ten(steps=10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 4, 8, generator=g).clamp(-2, 2)
    for step in LOUD:
        x[step * 4 : step * 4 + 4, 3] = 10.0
    return DataLoader(TensorDataset(x, torch.zeros(steps * 4, 1)), batch_size=4)


def test_a_rerun_starts_from_the_batch_as_loaded_when_the_step_changes_it_in_place():
    reporter = NaNSkipReporter(backward_origin=True, max_consecutive_skips=None, quiet=True)
    plugin = _fit(_Exponentiated(), [reporter], loader=_feature_at_ten(), init_scale=1.0, growth_interval=1000)
    assert plugin.history.skipped_steps == list(LOUD)
    told = [r["origin"] for r in reporter.skips][1:]  # the first starts the watch
    assert [(o["module"], o["float32"], o["bf16"]) for o in told] == [("", "finite", "finite")] * 2  # float16's range


@pytest.mark.parametrize("kind", ["tuple", "dict", "tensor"])
def test_a_batch_read_as_loaded_leaves_out_what_the_step_changed_in_place_unless_a_copy_was_kept(kind):
    from lightning_amp_plus.forensics.finder import OriginFinder

    x, y = torch.tensor([[float("nan"), 1.0]]), torch.zeros(1, 1)
    batch = {"x": x, "y": y} if kind == "dict" else x if kind == "tensor" else (x, y)
    finder = OriginFinder()
    finder.start_batch(batch)
    record = finder.current
    assert record.as_loaded() == (batch, [])  # nothing changed: the batch itself
    x.sub_(1.0)  # the step changes it in place
    loaded, unknown = record.as_loaded()
    assert [t is x for t in unknown] == [True]  # its NaN may be the batch's or the step's
    expected = {"x": None, "y": y} if kind == "dict" else None if kind == "tensor" else [None, y]
    assert loaded == expected
    record.loaded = {"x": x.clone(), "y": y} if kind == "dict" else x.clone() if kind == "tensor" else [x.clone(), y]
    loaded, unknown = record.as_loaded()  # a copy kept (reruns): it stands in for the changed tensor
    assert unknown == []
    assert (loaded["x"] if kind == "dict" else loaded if kind == "tensor" else loaded[0]) is not x


def test_views_of_one_storage_changed_in_place_are_read_as_they_are():
    from lightning_amp_plus.forensics.finder import OriginFinder

    data = torch.zeros(2, 4)
    x, y = data[:, :2], data[:, 2:]  # inputs and targets cut from one tensor
    finder = OriginFinder()
    finder.start_batch((x, y))
    y.clamp_(-1, 1)  # bumps the counter x shares: which one changed cannot be told
    assert finder.current.changed() == []


class _MixedInPlace(_Standardized):
    """Centres the batch over its samples, in place or not, after a NaN the data pipeline left in one sample."""

    def __init__(self, in_place):
        super().__init__()
        self.in_place = in_place

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.sub_(x.mean(0)) if self.in_place else x - x.mean(0)
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))).float(), y)


def _nan_rows(steps=10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 4, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.01  # finite targets
    for step in LOUD:
        x[step * 4, 3] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=4)


def test_changing_the_batch_in_place_or_not_tells_the_same_watched_origin():
    told = {}
    for in_place in (False, True):
        reporter = NaNSkipReporter(max_consecutive_skips=None, quiet=True)
        plugin = _fit(_MixedInPlace(in_place), [reporter], loader=_nan_rows())
        assert plugin.history.skipped_steps == list(LOUD)
        told[in_place] = [r["origin"] for r in reporter.skips][1:]  # the first starts the watch
    assert told[True] == told[False] == [{"phase": "forward", "module": "", "kind": "nan", "batch": "nonfinite"}] * 2


def test_the_minus_inf_maker_is_the_innermost_module_that_made_it():
    from lightning_amp_plus.forensics.verdict import first_born

    events = [  # parent(0) calls inner(1), which makes a float16 -inf that parent returns; taker(2) makes NaN of it
        (0, None, []),
        (1, None, []),
        (~1, "-inf16", []),
        (~0, "-inf16", []),
        (2, "-inf16", []),
        (~2, "nan", []),
    ]
    born = first_born(events)
    assert (born.call, born.kind, born.fed_by, born.fed_at) == (2, "nan", 1, 2)
    later = [*events[:4], (3, None, []), (~3, "-inf16", []), (2, "-inf16", []), (~2, "nan", [])]
    assert first_born(later).fed_by == 3  # a later module's own -inf: the latest maker


def test_a_batch_of_inference_tensors_is_observed_without_raising():
    from lightning_amp_plus.forensics.finder import OriginFinder

    with torch.inference_mode():
        x = torch.ones(2, 2)  # inference tensors have no version counter
    finder = OriginFinder()
    finder.start_batch((x, torch.zeros(2, 1)))
    assert [t.shape for t, _ in finder.current.versions] == [torch.Size([2, 1])]
    assert finder.current.as_loaded()[1] == []


class _RaisesOnce(_Standardized):
    def __init__(self):
        super().__init__()
        self.raised = False

    def training_step(self, batch, batch_idx):
        if not self.raised and batch_idx == 4:
            self.raised = True
            raise RuntimeError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_the_batch_is_read_as_its_step_received_it_in_a_second_fit_and_after_a_failed_one():
    reporter = NaNSkipReporter(max_consecutive_skips=None, quiet=True)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    model = _RaisesOnce()
    with pytest.raises(RuntimeError, match="the user's own error"):
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=10).fit(model, _constant_feature())
    for _ in range(2):  # the fit after the failed one, then a second fit
        make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=10).fit(_Standardized(), _constant_feature())
        assert plugin.history.skipped_steps == list(LOUD)
        assert [r["origin"]["phase"] for r in reporter.skips] == ["forward"] * 3  # the data was finite


class _BiasedAttentionGradPoison(_BiasedAttention):
    """The float16 mask as above, no forward overflow: the skips are an inf in one gradient (backward)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in LOUD:
            self.poisoned = self.head.weight.register_hook(lambda g: g * float("inf"))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if getattr(self, "poisoned", None) is not None:
            self.poisoned.remove()
            self.poisoned = None


def test_a_float16_mask_in_a_run_without_forward_overflows_is_no_origin_and_no_advice():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 * 2 * T, 8, generator=g)  # no loud batches: nothing overflows in forward
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.01), batch_size=2 * T)
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, quiet=True)
    advisor = AmpAdvisor(print_advice=False)
    plugin = _fit(_BiasedAttentionGradPoison(), [reporter, advisor], loader=loader)
    assert plugin.history.skipped_steps == list(LOUD)
    assert [r["origin"] for r in reporter.skips] == [{"phase": "backward"}] * 3  # the mask is named nowhere
    assert not {"fp32_module", "model_nonfinite", "bf16"} & {a.code for a in advisor.advice}


class _MinusHead(LightningModule):
    """A head whose float16 output overflows to -inf, straight into the loss (no later call takes it)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.head.weight.fill_(-2e3)
            self.head.bias.zero_()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        features = (self.body(x).abs() + 10).detach()  # the head's own overflow alone: no float16 backward below it
        return self.head(features).float().square().mean()  # -inf squared: an inf loss, inf gradients

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_float16_minus_inf_straight_into_the_loss_is_named_at_its_module_and_an_island_there_ends_it():
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    reporter = NaNSkipReporter(find_origin="watch", max_consecutive_skips=None, max_warnings=0)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=8.0, min_scale=0.0)], callbacks=[reporter], max_steps=3
    ).fit(_MinusHead(), data)
    assert [(r["origin"]["phase"], r["origin"].get("module")) for r in reporter.skips] == [("forward", "head")] * 3
    fixed = AmpPlusPrecision("16-mixed", init_scale=8.0, fp32_modules=["head"])  # the island the origin names
    make_trainer(plugins=[fixed], max_steps=3).fit(_MinusHead(), data)
    assert fixed.history.skipped_steps == []


_DEEP_GRAPH = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer
from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, GradUnderflowMonitor, NaNSkipReporter

class Recurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        h = x[:, 0]
        for t in range(20000):  # a graph of ~60,000 nodes in a chain
            h = torch.tanh(x[:, t % x.shape[1]] + h @ self.w)
        return h

class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.enc, self.head = Recurrence(), nn.Linear(8, 1)

    def training_step(self, batch, i):
        x, y = batch
        return (self.head(self.enc(x) * (1e5 if i == 2 else 1.0)).float() - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

reporter = NaNSkipReporter(find_origin="watch", quiet=True, max_consecutive_skips=None)
callbacks = [reporter, AmpAdvisor(print_advice=False), GradUnderflowMonitor(every_n_steps=1)]
x = torch.randn(8, 16, 8, generator=torch.Generator().manual_seed(0))
Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**8)],
        callbacks=callbacks).fit(Model(), DataLoader(TensorDataset(x, torch.zeros(8, 1)), batch_size=2))
print("told", [r["origin"].get("module") for r in reporter.skips])
"""


def test_a_skip_on_a_graph_tens_of_thousands_of_nodes_deep_does_not_crash_the_process():
    """Third break pass: reading a step's autograd graph tens of thousands of nodes deep (the loss's graph on a skip,
    the underflow monitor's float32 walk) made torch crash (SIGSEGV) when the graph was freed, two steps later. Every
    walk stops at `_limits.GRAPH_NODES`. Run apart: a crash would take the test session down."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEEP_GRAPH], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "told ['head']" in done.stdout
