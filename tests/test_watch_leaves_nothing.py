"""A watch you can forget is there: nothing on your modules, the model as it runs, never blind for good, bounded.

Each case is a fit with the watch on (``find_origin="watch"``, or started by a first skip), where the user's own code
does what users do mid-fit: script or save a module, add one, hook one, compile one, call one under ``vmap``.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_amp_plus import AmpPlusPrecision, NaNSkipReporter
from lightning_amp_plus.forensics import _tree
from lightning_amp_plus.forensics.observe import Watch
from tests.helpers.models import loud_batches
from tests.helpers.trainer import make_trainer

LOUD = (2, 5, 8)


class Boost(nn.Module):
    """``(|x| + 1) * factor``: beyond float16 (to ``+inf``) on the loud batches (x100), finite on the others."""

    def __init__(self, factor=1000.0):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return (x.abs() + 1) * self.factor


def _fit(model, reporter, steps=10, loader=None, trainer=None, **knobs):
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", **{"init_scale": 2.0**10, "growth_interval": 4, **knobs})
    trainer = trainer or make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=steps)
    trainer.fit(model, loader or loud_batches(steps, LOUD, 100.0))
    return plugin


def _origins(reporter):
    return {r["step"]: r["origin"] for r in reporter.skips}


def _reporter(**knobs):
    return NaNSkipReporter(**{"max_consecutive_skips": None, "quiet": True, "find_origin": "watch", **knobs})


class Chain(LightningModule):
    """``pre`` -> ``boost`` (overflows on the loud batches) -> ``head``."""

    def __init__(self):
        super().__init__()
        self.pre, self.boost, self.head = nn.Linear(8, 8), Boost(), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.boost(self.pre(x)) * 1e-3).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


# ------------------------------------------------------------------------- 1. nothing stored on your modules
class _Exports(Callback):
    """What users do at a batch's end, mid-fit: script the model for export, copy it, save it."""

    def __init__(self, path):
        self.path, self.seen = path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 4:
            return
        reporter = next(c for c in trainer.callbacks if isinstance(c, NaNSkipReporter))
        self.seen["watching"] = reporter.origins.watching
        self.seen["hooks"] = [(m._forward_hooks, m._forward_pre_hooks) for m in pl_module.modules() if m._forward_hooks]
        net = nn.Sequential(pl_module.pre, nn.ReLU(), pl_module.head)
        torch.jit.script(net)  # the export a user's callback makes
        torch.jit.trace(net, torch.randn(2, 8))
        teacher = copy.deepcopy(net)  # an EMA teacher
        torch.jit.script(teacher)
        torch.save(net, self.path)
        buffer = io.BytesIO()
        torch.save(teacher, buffer)
        self.seen["done"] = True


def test_scripting_copying_and_saving_a_watched_module_mid_fit_is_as_without_the_watch(tmp_path):
    exports = _Exports(str(tmp_path / "net.pt"))
    reporter = _reporter()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    make_trainer(plugins=[plugin], callbacks=[reporter, exports], max_steps=8).fit(
        Chain(), loud_batches(8, LOUD, 100.0)
    )
    assert exports.seen == {"watching": True, "hooks": [], "done": True}
    assert _origins(reporter)[2]["module"] == "boost"  # watched all along
    # a serving box with torch and not this package loads what was saved while watched
    loading = textwrap.dedent(
        f"""
        import sys
        sys.modules["lightning_amp_plus"] = None  # cannot be imported here
        import torch
        net = torch.load({str(tmp_path / "net.pt")!r}, weights_only=False)
        print(net(torch.randn(2, 8)).shape)
        """
    )
    done = subprocess.run([sys.executable, "-c", loading], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch.Size([2, 1])" in done.stdout


def test_no_hook_is_left_and_none_was_ever_on_the_modules():
    watch = Watch()
    model = Chain()
    watch.install(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    watch.begin()
    model.boost(model.pre(torch.randn(4, 8)))
    assert [i for i, _ in watch.trace] == [0, ~0, 1, ~1]  # pre, then boost: both watched
    watch.remove()
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


# ------------------------------------------------------------------------- 2. the model that runs
class Growing(LightningModule):
    """A block appended to a ModuleList at step 3 (after the watch started): it overflows on the loud batches."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 3 and len(self.blocks) == 1:
            self.blocks.append(Boost())
        h = x
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h * 1e-3).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_module_appended_mid_fit_is_watched_from_its_first_call():
    reporter = _reporter()
    _fit(Growing(), reporter)
    origins = _origins(reporter)
    assert origins[5]["module"] == origins[8]["module"] == "blocks.1"


class Cleaned(LightningModule):
    """``noisy`` overflows on the loud batches; the user's hook, registered at step 3, clamps its output. The real
    overflow is ``boost``'s, later."""

    def __init__(self):
        super().__init__()
        self.pre, self.noisy, self.boost, self.head = nn.Linear(8, 8), Boost(1e4), Boost(1e3), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 3 and not self.noisy._forward_hooks:
            self.noisy.register_forward_hook(lambda m, a, out: out.clamp(-1, 1))
        h = self.noisy(self.pre(x))
        return nn.functional.mse_loss(self.head(self.boost(h * 100) * 1e-3).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_users_hook_registered_after_the_watch_is_read_after_it_acted():
    reporter = _reporter()
    _fit(Cleaned(), reporter)
    origins = _origins(reporter)
    assert origins[2]["module"] == "noisy"  # not yet cleaned
    assert origins[5]["module"] == origins[8]["module"] == "boost"  # the model never received noisy's inf


# ------------------------------------------------------------------------- compiled code
def _compile_counts():
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()), sum(counters["graph_break"].values())


class CompiledInPlace(Chain):
    def __init__(self):
        super().__init__()
        self.boost.compile(backend="eager")


def test_a_module_compiled_in_place_adds_no_graph_break_or_recompile_and_is_told_once():
    import torch._dynamo

    counts = {}
    for with_watch in (False, True):
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        callbacks = [_reporter()] if with_watch else []
        torch.manual_seed(0)
        plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
        make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=10).fit(
            CompiledInPlace(), loud_batches(10, LOUD, 100.0)
        )
        counts[with_watch] = _compile_counts()
        if with_watch:
            origins = _origins(callbacks[0])
    assert counts[True] == counts[False]
    told = [o for o in origins.values() if "compiled in place" in (o.get("reason") or "")]
    assert told
    assert all(o["module"] == "" and "boost" in o["reason"] for o in told)


class CompiledWrapper(Chain):
    def __init__(self):
        super().__init__()
        self.boost = torch.compile(Boost(), backend="eager")


def test_a_compiled_wrapper_is_watched_as_one_module_without_torchs_global_hook_warning(recwarn):
    reporter = _reporter()
    _fit(CompiledWrapper(), reporter)
    origins = _origins(reporter)
    assert origins[5]["module"] == origins[8]["module"] == "boost"
    assert not [w for w in recwarn if "global hooks" in str(w.message)]


class CompiledFunction(Chain):
    """The modules called from a compiled function: the watch cannot see them."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not hasattr(self, "_body"):
            self._body = torch.compile(lambda h: self.boost(self.pre(h)), backend="eager")
        return nn.functional.mse_loss(self.head(self._body(x) * 1e-3).float(), y)


def test_modules_called_from_a_compiled_function_are_told_unwatched_never_read_as_the_loss():
    reporter = _reporter()
    _fit(CompiledFunction(), reporter)
    for step in LOUD:
        origin = _origins(reporter)[step]
        assert origin["phase"] != "loss" or "compiled" in origin.get("reason", ""), origin
        assert "compiled" in origin.get("reason", ""), origin


# ------------------------------------------------------------------------- 3. never blind, never carried
class Vmapped(Chain):
    """Each step also runs ``ensemble`` under ``torch.func.vmap`` (a vmapped ensemble): unreadable calls."""

    def __init__(self):
        super().__init__()
        self.ensemble = nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        spread = torch.func.vmap(self.ensemble)(x.unsqueeze(0).expand(3, -1, -1))
        return super().training_step((x + 0 * spread.mean(0), y), batch_idx)


def test_a_vmapped_call_is_left_out_of_its_reading_alone_and_later_skips_are_named():
    reporter = _reporter()
    _fit(Vmapped(), reporter)
    assert [o["module"] for s, o in sorted(_origins(reporter).items())] == ["boost"] * 3


class Nested(Chain):
    """A module called with a strided nested tensor each step; its loss overflows in the own code on loud steps."""

    def __init__(self):
        super().__init__()
        self.ragged = nn.Identity()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.ragged(torch.nested.nested_tensor([x[0], x[1, :3]]))
        return nn.functional.mse_loss((self.head(self.pre(x)) * 1e5).float(), y)


def test_a_nested_tensor_call_is_said_unread_in_a_short_reason_of_a_skip_it_could_have_caused():
    reporter = _reporter()
    _fit(Nested(), reporter)
    for origin in (_origins(reporter)[step] for step in LOUD):
        assert origin["phase"] == "loss", origin
        assert origin["reason"] == "ragged took or gave a nested tensor, unread", origin
        assert len(origin["reason"]) <= 200


def test_a_reused_reporter_starts_a_new_watch_in_a_new_fit():
    reporter = NaNSkipReporter(max_consecutive_skips=None, quiet=True)
    _fit(Vmapped(), reporter)
    assert not reporter.origins.watching  # taken off at the fit's end
    _fit(Chain(), reporter)
    origins = _origins(reporter)
    assert origins[2]["reason"] == "every module is watched from the next step"  # a new fit, a new watch
    assert origins[5]["module"] == origins[8]["module"] == "boost"


# ------------------------------------------------------------------------- 4. bounded
class FlatLoss(LightningModule):
    """A loss module called on the flattened outputs (4M elements): not the batch's rows."""

    def __init__(self):
        super().__init__()
        self.net, self.criterion = nn.Linear(8, 8), nn.MSELoss()


def test_what_a_call_keeps_is_a_few_numbers_whatever_the_tensors_size():
    model = FlatLoss()
    watch = Watch()
    watch.install(model)
    batch = torch.randn(4, 8)
    trace = watch.begin(rows={4})
    model.net(batch)  # the batch's own rows, per sample (the step's first call)
    big = torch.randn(4_000_000)
    model.criterion(big, big * 2)
    watch.trace = None
    kept = [
        t
        for _, entries in trace
        for entry in entries
        for t in (entry[1] if isinstance(entry[1], tuple) else (entry[1],))
    ]
    assert sum(t.numel() * t.element_size() for t in kept) < 1_000  # bytes: not 32 MB
    per_sample = [entry for index, entries in trace if index == 0 for entry in entries]
    assert per_sample[0][1][0].shape == (4,)  # the batch's rows are still read per sample
    watch.remove()


@dataclasses.dataclass
class _Node:
    value: torch.Tensor
    parent: object = None
    children: list = dataclasses.field(default_factory=list)


def _tree_of(depth, width=3, parent=None):
    node = _Node(torch.ones(1), parent)
    if depth:
        node.children = [_tree_of(depth - 1, width, node) for _ in range(width)]
    return node


def test_a_parent_linked_tree_is_walked_once_per_object(monkeypatch):
    root = _tree_of(6)  # 1093 nodes
    visits = []
    real = _tree._node
    monkeypatch.setattr(_tree, "_node", lambda value, *a: visits.append(id(value)) or real(value, *a))
    found = list(_tree.tensors(root))
    assert len(found) == 1093 == len({id(t) for t in found})
    assert len(visits) == len(set(visits))  # no object twice: parent links cost nothing


# ------------------------------------------------------------------------- the break pass's cases
class _InPlace(nn.Module):
    def forward(self, x):
        return x.abs_().add_(1).mul_(1000.0)  # overflows in the tensor it was given


class InPlaceChain(Chain):
    def __init__(self):
        super().__init__()
        self.boost = _InPlace()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.boost(self.pre(x) * 1) * 1e-3).float(), y)


def test_a_module_that_overflows_in_the_tensor_it_was_given_is_named():
    reporter = _reporter()
    _fit(InPlaceChain(), reporter)
    assert [o["module"] for o in _origins(reporter).values()] == ["boost"] * 3


class TwoNew(Chain):
    """At step 2 the step makes two modules and calls both: the second overflows."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.pre(x)
        if self.global_step == 2 and not hasattr(self, "late"):
            self.adapter = nn.Identity()
            h = self.adapter(h)  # the model walked again here: `late` is not there yet
            self.late = Boost()
        if hasattr(self, "late"):
            h = self.late(h)
        return nn.functional.mse_loss(self.head(h * 1e-3).float(), y)


def test_every_module_made_in_one_batch_is_watched_from_its_first_call():
    reporter = _reporter()
    _fit(TwoNew(), reporter)
    assert [o["module"] for o in _origins(reporter).values()] == ["late"] * 3


class _Cleaning(Callback):
    """The user's own global hook (registered after the watch started), or a module hook cleaning via `.data`."""

    def __init__(self, how):
        self.how, self.handle = how, None

    def on_train_start(self, trainer, pl_module):
        noisy = pl_module.noisy
        if self.how == "global":
            self.handle = torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, out: out.clamp(-1, 1) if m is noisy else None
            )
        else:

            def clean(module, args, out):
                out.data.clamp_(-1, 1)  # through `.data`: no version bump

            self.handle = noisy.register_forward_hook(clean)

    def on_train_end(self, trainer, pl_module):
        self.handle.remove()


class CleanedAlways(Cleaned):
    """``noisy`` overflows on the loud batches and your hook cleans it; ``boost`` overflows there too, later."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.mid(self.noisy(self.pre(x)))
        return nn.functional.mse_loss(self.head(self.boost(self.pre(x)) * 1e-3 + h).float(), y)

    def __init__(self):
        super().__init__()
        self.mid = nn.Identity()


@pytest.mark.parametrize("how", ["global", "data"])
def test_an_output_your_hook_cleaned_is_not_blamed_however_the_hook_was_made(how):
    reporter = _reporter()
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    make_trainer(plugins=[plugin], callbacks=[reporter, _Cleaning(how)], max_steps=10).fit(
        CleanedAlways(), loud_batches(10, LOUD, 100.0)
    )
    assert [_origins(reporter)[step]["module"] for step in LOUD] == ["boost"] * 3


def test_a_compiled_function_is_not_recompiled_by_the_watch_fit_after_fit():
    from torch._dynamo.utils import counters

    frames = {}
    for name in ("none", "watch"):
        torch._dynamo.reset()
        counters.clear()
        model = CompiledFunction()
        for _ in range(3):
            _fit(model, _reporter() if name == "watch" else None) if name == "watch" else _fit_plain(model)
        frames[name] = counters["frames"]["ok"]
    assert frames["watch"] == frames["none"]


def _fit_plain(model):
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=4)
    make_trainer(plugins=[plugin], max_steps=10).fit(model, loud_batches(10, LOUD, 100.0))


class Traced(Chain):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            torch.jit.trace(nn.Sequential(self.pre, self.boost), batch[0])
        return super().training_step(batch, batch_idx)


def test_tracing_inside_the_step_gets_no_warning_and_no_event_from_the_watch(recwarn):
    reporter = _reporter()
    _fit(Traced(), reporter)
    assert not [w for w in recwarn if "lightning_amp_plus" in w.filename]
    assert [o["module"] for o in _origins(reporter).values()] == ["boost"] * 3


class Threaded(Chain):
    def training_step(self, batch, batch_idx):
        from concurrent.futures import ThreadPoolExecutor

        x, y = batch

        def body():
            with torch.autocast("cpu", dtype=torch.float16):  # autocast is the thread's own
                return self.boost(self.pre(x))

        with ThreadPoolExecutor(1) as pool:
            h = pool.submit(body).result()
        return nn.functional.mse_loss(self.head(h * 1e-3).float(), y)


def test_a_module_called_from_another_thread_is_said_unread():
    reporter = _reporter()
    _fit(Threaded(), reporter)
    for origin in _origins(reporter).values():
        assert origin["reason"] in ("pre was called from another thread, unread",), origin


class _Proxy:
    """A lazy proxy whose target failed to load: reading its class raises."""

    @property
    def __class__(self):
        raise RuntimeError("proxy target failed to load; " + "details " * 60)


class WithProxy(Chain):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)


@pytest.mark.parametrize("find_origin", [True, "watch"])
def test_a_batch_holding_an_object_that_cannot_be_read_never_stops_the_fit_or_the_watch(find_origin):
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    base = loud_batches(10, LOUD, 100.0)
    loader = DataLoader(list(base), batch_size=None, collate_fn=lambda b: [b[0], b[1], SimpleNamespace(m=_Proxy())])
    reporter = _reporter(find_origin=find_origin)
    _fit(WithProxy(), reporter, loader=loader)
    origins = _origins(reporter)
    assert origins[5]["module"] == origins[8]["module"] == "boost"
    assert all(len(o.get("reason", "")) <= 200 for o in origins.values())


def test_lightnings_recipe_a_lightning_module_compiled_whole_is_told_once(caplog):
    """`trainer.fit(torch.compile(model))`: the watch cannot sit inside the graph; each skip says so, printed once."""
    import logging

    reporter = NaNSkipReporter(max_consecutive_skips=None)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lightning_amp_plus"):
        make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**10)], callbacks=[reporter], max_steps=10
        ).fit(torch.compile(Chain(), backend="eager"), loud_batches(10, LOUD, 100.0))
    told = [r["origin"] for r in reporter.skips if r["step"] in LOUD]
    assert told
    assert all("compiled as a whole" in o["reason"] for o in told)
    said = [r.getMessage() for r in caplog.records if "compiled as a whole" in r.getMessage()]
    assert len([m for m in said if not m.startswith("step ")]) <= 1  # the note, once
    assert not torch.nn.modules.module._global_forward_hooks  # nothing was hooked


class _SquaredError(nn.modules.loss._Loss):
    """A loss held as a module, computed in the precision it is given: its square overflows float16."""

    def forward(self, prediction, target):
        return ((prediction - target.to(prediction.dtype)) ** 2).mean()


class _OwnSquaredError(nn.Module):
    """The same loss as a plain ``nn.Module`` of your own (no torch loss class to tell it by)."""

    def forward(self, prediction, target):
        return ((prediction - target.to(prediction.dtype)) ** 2).mean()


class WithCriterion(LightningModule):
    def __init__(self, fixed=False):
        super().__init__()
        self.pre, self.head, self.criterion = nn.Linear(8, 8), nn.Linear(8, 1), _SquaredError()
        self.fixed = fixed

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.pre(x))
        logits = logits.float() if self.fixed else logits  # nonfinite_loss's fix, as printed
        return self.criterion(logits * 30, y).float()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_a_loss_held_as_a_module_is_the_loss_phase_never_an_island():
    """Issue 52: `self.criterion` (a torch loss class) is the loss, not a module to run in float32; the fix printed
    for the loss, pasted, leaves no skip born before backward."""
    from lightning_amp_plus import AmpAdvisor

    reporter, advisor = _reporter(), AmpAdvisor(print_advice=False)
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    make_trainer(plugins=[plugin], callbacks=[reporter, advisor], max_steps=10).fit(
        WithCriterion(), loud_batches(10, LOUD, 100.0)
    )
    told = [_origins(reporter)[step] for step in LOUD]
    assert [o["phase"] for o in told] == ["loss"] * 3
    assert "fp32_module" not in [a.code for a in advisor.advice]
    (said,) = [a for a in advisor.advice if a.code == "nonfinite_loss"]
    assert "logits.float()" in said.fix
    fixed = _reporter()  # the fix as printed: the logits in float32 before the loss
    torch.manual_seed(0)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=2.0**10)], callbacks=[fixed], max_steps=10).fit(
        WithCriterion(fixed=True), loud_batches(10, LOUD, 100.0)
    )
    # the loss is finite now: what skips is the scale's calibration against this loss's size (backward), told so
    assert [o["phase"] for o in _origins(fixed).values()] == ["backward"] * len(fixed.skips)


class _ContrastiveLoss(nn.Module):
    """A CLIP-style loss class of your own: its matmul runs in float16 under autocast (`logits.float()` before it is
    cast back down) and overflows on loud batches."""

    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(4.6))

    def forward(self, a, b):
        logits = a @ b.t() * self.logit_scale.exp()
        labels = torch.arange(a.shape[0])
        return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.t(), labels)) / 2


class _WithOwnLoss(LightningModule):
    def __init__(self, criterion):
        super().__init__()
        self.img, self.txt, self.criterion = nn.Linear(8, 16), nn.Linear(8, 16), criterion

    def training_step(self, batch, batch_idx):
        x, y = batch
        if isinstance(self.criterion, _ContrastiveLoss):
            return self.criterion(self.img(x), self.txt(x.flip(0)))
        return self.criterion(self.img(x)[:, :1] * 30, y).float() + 0.1 * self.txt.weight.float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(
    ("criterion", "scale"), [(_OwnSquaredError, 100.0), (_ContrastiveLoss, 25.0)], ids=["squared-error", "contrastive"]
)
def test_your_own_loss_class_is_a_module_and_its_island_as_printed_ends_the_skips(criterion, scale):
    """Decided on issue 52, measured: a loss class of your own (a plain `nn.Module`) is a module like any other. Its
    island runs it, and the float16 values it takes, in float32: that ends both a square of float16 predictions and a
    float16 matmul inside it (a CLIP-style loss), where the loss phase's `logits.float()` does not end the second
    (autocast casts them back down for the matmul). A torch loss class stays the loss phase (above)."""
    from lightning_amp_plus import AmpAdvisor

    reporter, advisor = _reporter(), AmpAdvisor(print_advice=False)
    torch.manual_seed(0)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1.0)], callbacks=[reporter, advisor], max_steps=10
    ).fit(_WithOwnLoss(criterion()), loud_batches(10, LOUD, scale))
    told = _origins(reporter)
    assert sorted(told) == list(LOUD)
    assert [(told[s]["phase"], told[s].get("module")) for s in LOUD[1:]] == [("forward", "criterion")] * 2
    (said,) = [a for a in advisor.advice if a.code == "fp32_module"]
    pasted = eval(said.fix, {"AmpPlusPrecision": AmpPlusPrecision})  # as printed
    fixed = _reporter()
    torch.manual_seed(0)
    make_trainer(plugins=[pasted], callbacks=[fixed], max_steps=10).fit(
        _WithOwnLoss(criterion()), loud_batches(10, LOUD, scale)
    )
    assert [o["phase"] for o in _origins(fixed).values()] == ["backward"] * len(fixed.skips)


class _HeadReducedByTheLoss(LightningModule):
    """The look-alike: a head whose float16 output overflows, reduced by the loss (``.mean()``): a module's output
    the loss is computed from, not a loss."""

    def __init__(self):
        super().__init__()
        self.pre, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        with torch.no_grad():
            self.head.weight.mul_(1e4)  # its float16 output overflows on the loud batches

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.head(self.pre(x)).mean().float()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_modules_output_the_loss_reduces_is_not_a_loss():
    """The look-alike of the own loss class: the head that overflowed on its own is named (an island helps)."""
    reporter = _reporter()
    torch.manual_seed(0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0)
    make_trainer(plugins=[plugin], callbacks=[reporter], max_steps=10).fit(
        _HeadReducedByTheLoss(), loud_batches(10, LOUD, 100.0)
    )
    told = _origins(reporter)
    assert sorted(told) == list(LOUD)
    assert [(told[step]["phase"], told[step].get("module")) for step in LOUD] == [("forward", "head")] * 3


class _TeacherScaledInPlace(LightningModule):
    """Your code scales a teacher module's float16 output in place (x 1e6: +inf) between two module calls, under
    ``inference_mode``: an inference tensor has no version counter to tell the change."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.student = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        with torch.inference_mode():
            features = self.body(x)
            features.mul_(1e6)
            target = self.head(features)
        return (self.student(x).float() - target.float()).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_an_inference_tensor_changed_in_place_between_calls_is_read_again_not_taken_from_the_cache():
    """Break pass: the read-once cache took an inference tensor as unchanged; the head was named (its island did
    not help, and the next run called it the model's own). Your code made them: told as such."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_amp_plus import AmpPlusPrecision, NaNSkipReporter
    from tests.helpers.trainer import make_trainer

    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, quiet=True)
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.zeros(16, 1)), batch_size=4)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[reporter], max_steps=3).fit(
        _TeacherScaledInPlace(), loader
    )
    assert [r["origin"].get("module") for r in reporter.skips][1:] == ["", ""]  # the step's own code
