"""AmpPlusPrecision(auto_islands=True): the run finds its own fp32 islands by observation, on real CPU float16 fits."""

import csv
import logging
import sys

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_amp_plus import AmpAdvisor, AmpPlusFSDPPrecision, AmpPlusPrecision, NaNSkipReporter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

LINE = "`AmpPlusPrecision(auto_islands=True)`"


class SumPool(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)  # 512 rows of ~200: beyond float16's 65504, finite in float32


class Chain(LightningModule):
    """Sum pooling that overflows float16; as an island its float32 output overflows the head (the consumer)."""

    def __init__(self, pool=None, calls=None):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.pool = pool if pool is not None else SumPool()
        self.head = nn.Linear(32, 1)
        self.calls = calls  # a list: each training_step call appends its batch index (nothing runs twice)
        with torch.no_grad():
            self.embed.weight.fill_(0.5)
            self.embed.bias.zero_()
            self.head.weight.fill_(0.01)

    def training_step(self, batch, batch_idx):
        if self.calls is not None:
            self.calls.append(batch_idx)
        x, y = batch
        return ((self.head(self.pool(self.embed(x))) / 1e6 - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(64, 512, 16, generator=generator) * 10 + 20
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(64, 1)), batch_size=8)


class Attend(nn.Module):
    """Attention whose fully masked rows softmax to NaN in any precision (the model's own, no island fixes it)."""

    def forward(self, x, mask):
        scores = (x @ x.transpose(1, 2)).masked_fill(mask, float("-inf"))
        return scores.softmax(-1) @ x


class Padded(LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attend = Attend()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        mask = torch.zeros(x.shape[0], 4, 4, dtype=torch.bool)
        mask[0, 1] = True  # one all-padding row
        return self.attend(self.proj(x), mask).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x = torch.randn(32, 4, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(LINE)]


def fit(model, plugin, max_steps=16, **kwargs):
    make_trainer(plugins=[plugin], max_steps=max_steps, **kwargs).fit(model)
    return plugin


@pytest.mark.parametrize("with_reporter", [False, True])
def test_a_chain_finds_its_islands_in_one_run_and_the_printed_fix_trains_from_the_first_step(
    caplog, tmp_path, with_reporter
):
    caplog.set_level(logging.WARNING, logger="lightning_amp_plus")
    calls = []
    reporter = NaNSkipReporter(report_path=tmp_path / "skips.json")
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
    logger = CSVLogger(tmp_path, name="auto")
    fit(Chain(calls=calls), plugin, callbacks=[reporter] if with_reporter else [], logger=logger)
    assert calls == list(range(8)) * 2  # each batch's step ran once: nothing of the user's code ran twice
    # the first skip starts the watch; the next names the pool; its float32 output then overflows the head
    assert plugin.history.skipped_steps == [0, 1, 2]
    said = lines(caplog)
    assert (
        said[0]
        == f"{LINE}: 'pool' made inf in float16 at step 1 from finite inputs: it runs in float32 from the next step."
    )
    assert (
        said[1]
        == f"{LINE}: 'head' made inf in float16 at step 2 from finite inputs: it runs in float32 from the next step."
    )
    fix = 'AmpPlusPrecision("16-mixed", init_scale=2.0**4, fp32_modules=["pool", "head"])'
    assert said[-1] == f"{LINE} ran 'pool', 'head' in float32. For the next run: {fix}"
    if with_reporter:  # the reporter's origins agree: a forward-born skip named each, none after the last island
        origins = [(r["step"], r["origin"].get("module")) for r in reporter.skips]
        assert origins == [(0, None), (1, "pool"), (2, "head")]
    with open(f"{logger.log_dir}/metrics.csv") as f:
        logged = [(int(r["step"]), float(r["amp/auto_islands"])) for r in csv.DictReader(f) if r["amp/auto_islands"]]
    assert logged == [(1, 1.0), (2, 2.0)]

    pasted = eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})  # the fix, pasted as printed
    assert fit(Chain(), pasted).history.skipped_steps == []


def test_without_auto_islands_the_same_chain_skips_on(caplog):
    plugin = fit(Chain(), AmpPlusPrecision("16-mixed", init_scale=2.0**4), max_steps=12)
    assert plugin.history.skipped_steps == list(range(12))  # the measured contrast: every update skipped


def test_an_island_that_makes_nan_in_float32_too_is_taken_out_and_told_as_the_models_own(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_amp_plus")
    plugin = fit(Padded(), AmpPlusPrecision("16-mixed", auto_islands=True), max_steps=6)
    said = lines(caplog)
    assert said[0].startswith(f"{LINE}: 'attend' made nan in float16 at step 1 from finite inputs")
    assert said[1].startswith(f"{LINE}: 'attend' made nan again in float32 at step 2: float32 makes them too")
    assert len(said) == 2  # never added again, and no fix line: no island kept
    assert plugin.auto_islands_fix() is None
    assert plugin.history.skipped_steps == list(range(6))  # the model's own NaN: no island helps, none kept


def test_a_healthy_run_is_bit_identical_with_and_without_auto_islands():
    def trained(auto):
        torch.manual_seed(0)
        model = Chain()
        with torch.no_grad():
            model.embed.weight.fill_(0.001)  # no overflow anywhere
        plugin = fit(model, AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=auto), max_steps=6)
        return plugin, [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    (plugin, weights, rng), (_, plain, plain_rng) = trained(True), trained(False)
    assert plugin.history.skipped_steps == []
    assert all(torch.equal(a, b) for a, b in zip(weights, plain, strict=True))
    assert torch.equal(rng, plain_rng)
    assert not plugin._auto.finder.watching  # no skip: the watch never started
    assert plugin.auto_islands_fix() is None


def test_islands_are_kept_in_checkpoints_and_a_resumed_run_keeps_them(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="lightning_amp_plus")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    plugin = fit(
        Chain(),
        AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True),
        max_steps=4,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    saved = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=False)
    assert saved["AmpPlusPrecision"]["auto_islands"] == {"added": ["pool", "head"], "own": []}
    assert plugin.fp32_module_names == []  # removed at teardown, as given islands are

    resumed = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
    make_trainer(plugins=[resumed], max_steps=10).fit(Chain(), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert resumed.history.skipped_steps == [0, 1, 2]  # the checkpoint's history: no skip after the resume
    assert resumed._auto.added == ["pool", "head"]

    caplog.clear()
    off = AmpPlusPrecision("16-mixed", init_scale=2.0**4)
    make_trainer(plugins=[off], max_steps=6).fit(Chain(), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    (told,) = [r.getMessage() for r in caplog.records if "do not run" in r.getMessage()]
    assert told == (
        '`AmpPlusPrecision`: the checkpoint\'s islands found by observation ("pool", "head") do not run: auto_islands'
        ' is off. HINT: give `fp32_modules=["pool", "head"]`, or `auto_islands=True`.'
    )


def test_a_new_trainer_starts_without_the_last_fits_islands():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
    fit(Chain(), plugin, max_steps=4)
    assert plugin._auto.added == ["pool", "head"]
    fit(Chain(), plugin, max_steps=3)  # a new Trainer: a new run, its own findings
    assert plugin.history.skipped_steps == [0, 1, 2]  # no island ran from its start
    assert plugin._auto.added == ["pool", "head"]  # found again, by this run's own observation


def test_a_compiled_module_that_overflows_is_told_once_and_the_run_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_amp_plus")
    pool = torch.compile(SumPool(), backend="eager")
    plugin = fit(Chain(pool=pool), AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True), max_steps=6)
    refused = [line for line in lines(caplog) if "cannot be made an island" in line]
    assert refused == [
        f"{LINE}: 'pool' overflowed at step 1 but cannot be made an island: it is compiled (torch.compile)."
    ]
    assert plugin._auto.added == []


def test_bf16_and_sharded_plugins():
    plugin = fit(Chain(), AmpPlusPrecision("bf16-mixed", auto_islands=True), max_steps=2)
    assert plugin._auto is None  # no float16 range to escape: nothing is watched or added
    with pytest.raises(ValueError, match=r"AmpPlusFSDPPrecision\(auto_islands=True\)` is invalid: a sharded model"):
        AmpPlusFSDPPrecision("16-mixed", auto_islands=True)
    with pytest.raises(TypeError, match="auto_islands"):
        AmpPlusPrecision("16-mixed", auto_islands="yes")


def test_a_corrupt_islands_state_is_refused_with_its_key_named():
    plugin = AmpPlusPrecision("16-mixed", auto_islands=True)
    state = {**plugin.state_dict(), "auto_islands": ["pool"]}
    with pytest.raises(TypeError, match=r"`checkpoint\['AmpPlusPrecision'\]\['auto_islands'\]` is invalid"):
        plugin.load_state_dict(state)


DDP = """
import json, sys
import torch
from lightning.pytorch import Trainer
from lightning_amp_plus import AmpPlusPrecision
from tests.test_auto_islands import Chain


class OneRankOverflows(Chain):
    def training_step(self, batch, batch_idx):
        x, y = batch
        scale = 1.0 if self.global_rank == 1 else 1e-3  # rank 0's data never overflows: only rank 1 sees it born
        return super().training_step((x * scale, y), batch_idx)


out = sys.argv[1]
model = OneRankOverflows()
plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_steps=6, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
checksum = float(sum(p.double().sum() for p in model.parameters()))
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({"skipped": plugin.history.skipped_steps, "added": plugin._auto.added, "checksum": checksum}, f)

from tests.helpers.sharded import leave  # noqa: E402

leave()
"""


@pytest.mark.slow
def test_under_ddp_the_ranks_agree_on_the_islands_one_rank_saw_born(tmp_path):
    from tests.helpers.sharded import run_script

    zero, one = run_script(DDP, tmp_path, timeout=300)
    assert zero["added"] == one["added"] == ["pool", "head"]  # rank 0 never saw an overflow: it follows rank 1
    assert zero["skipped"] == one["skipped"] == [0, 1, 2]
    assert zero["checksum"] == one["checksum"]


class ManualChain(Chain):
    """Manual optimization: ``manual_backward`` runs inside the step's autocast."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_in_manual_optimization_the_islands_backward_runs_in_float32_too():
    plugin = fit(ManualChain(), AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True), max_steps=10)
    assert plugin._auto.added == ["pool", "head"]
    assert plugin.history.skipped_steps == [0, 1, 2]  # the islands' backward matmuls are not autocast back to float16
    pasted = AmpPlusPrecision("16-mixed", init_scale=2.0**4, fp32_modules=["pool", "head"])
    assert fit(ManualChain(), pasted, max_steps=4).history.skipped_steps == []


class Rebuilt(Chain):
    """Replaces its pool with a new instance at step 6 (a stage change that rebuilds a block)."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 6:
            self.pool = SumPool()


def test_a_module_replaced_under_its_islands_name_is_made_an_island_again_not_called_the_models_own(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_amp_plus")
    plugin = fit(Rebuilt(), AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True))
    assert plugin.history.skipped_steps == [0, 1, 2, 6]  # the new instance ran in float16 once, then as an island
    assert plugin._auto.added == ["pool", "head"]
    assert plugin._auto.own == []
    assert not any("again in float32" in line for line in lines(caplog))


class Late(Chain):
    """At step 3 a new pooling module is added (and the old one replaced by an identity)."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and not hasattr(self, "late"):
            self.late, self.pool = SumPool(), nn.Identity()
        if hasattr(self, "late"):
            x, y = batch
            return ((self.head(self.late(self.pool(self.embed(x)))) / 1e6 - y) ** 2).mean()
        return super().training_step(batch, batch_idx)


def test_an_island_made_mid_fit_is_left_to_auto_islands_in_the_fix_line_which_pasted_builds_and_trains():
    plugin = fit(Late(), AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True))
    assert plugin._auto.added == ["pool", "head", "late"]
    fix = plugin.auto_islands_fix()
    assert fix == 'AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True, fp32_modules=["pool", "head"])'
    pasted = eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})  # "late" does not exist at connect: not named
    assert fit(Late(), pasted).history.skipped_steps == [3, 4]  # late found by observation again, then none


class Dispatch(Chain):
    """MoE-style dispatch: an expert's output written into a float16 buffer (``index_put`` is strict on dtypes)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        out = torch.zeros(h.shape[0], h.shape[2], dtype=h.dtype)
        out[torch.arange(h.shape[0])] = self.pool(h)
        return ((self.head(out) / 1e6 - y) ** 2).mean()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
def test_a_dtype_mismatch_an_island_causes_in_the_users_code_says_which_islands_and_the_one_line_cure():
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
    with pytest.raises(RuntimeError, match="dtypes match") as raised:
        fit(Dispatch(), plugin)
    assert raised.value.__notes__ == [
        "AmpPlusPrecision(auto_islands=True) runs 'pool' in float32, and an island's output stays float32: code that"
        " writes it into a float16 tensor (out[idx] = island(x), index_add_, scatter_) needs `.to(out.dtype)` there."
    ]


class _Root(nn.Module):
    """A square root of values below 0 (NaN in any precision); ``guarded``: its input clamped, as the fix says."""

    def __init__(self, guarded=False):
        super().__init__()
        self.guarded = guarded

    def forward(self, x):
        shifted = x - 5.0
        return torch.sqrt(shifted.clamp_min(1e-12) if self.guarded else shifted)


class _Rooted(TinyModel):
    def __init__(self, guarded=False):
        super().__init__(lr=0.0)
        self.pre, self.sq = nn.Linear(8, 8), _Root(guarded)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(self.sq(self.pre(x))).float(), y)


def test_a_module_float32_makes_nan_in_too_is_the_models_own_and_its_guard_fixes_the_ops_input():
    """Break pass on issue 52: auto_islands took `sq` out (float32 made NaN too) while the advisor still printed it as
    an island, and model_nonfinite's fix was a nan_to_num of the output (its backward stays NaN). Now the advice is
    model_nonfinite, naming the op, and its guard on the op's input trains."""
    advisor = AmpAdvisor(print_advice=False)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True)
    make_trainer(plugins=[plugin], callbacks=[advisor], max_steps=8).fit(_Rooted())
    assert plugin._auto.own == ["sq"]
    assert [a.code for a in advisor.advice][:1] == ["model_nonfinite"]
    assert "fp32_module" not in [a.code for a in advisor.advice]
    advice = advisor.advice[0]
    assert "(a sqrt: its input is out of its domain)" in advice.message
    assert advice.fix.startswith("torch.sqrt(x.clamp_min(1e-12))")
    guarded = AmpPlusPrecision("16-mixed", init_scale=2.0**4)
    make_trainer(plugins=[guarded], max_steps=8).fit(_Rooted(guarded=True))  # the guard, as printed, on its input
    assert guarded.history.skipped_steps == []


def test_beside_auto_islands_each_skip_is_told_as_it_ran_and_the_advisor_prints_the_plugins_line(tmp_path):
    """A skip is judged by the islands its step ran with: auto_islands, called first, makes the named module an
    island at that skip, and the reporter read it after (before: "float32 made them too", a claim nothing measured,
    and the advisor fell back to skip_rate with "no rule here explains why"). The advisor says what auto_islands
    measured in the run and prints the plugin's own line for the next run, which trains."""
    reporter = NaNSkipReporter(report_path=tmp_path / "skips.json")
    advisor = AmpAdvisor(print_advice=False)
    plugin = fit(
        Chain(), AmpPlusPrecision("16-mixed", init_scale=2.0**4, auto_islands=True), callbacks=[reporter, advisor]
    )
    told = {r["step"]: r["origin"] for r in reporter.skips}
    assert told[1] == {"phase": "forward", "module": "pool", "kind": "inf"}
    assert told[2] == {"phase": "forward", "module": "head", "kind": "inf"}
    (advice,) = advisor.advice
    assert advice.code == "fp32_module"
    assert "no skipped update was born in forward after the last (measured in this run)" in advice.message
    assert (
        advice.fix
        == plugin.auto_islands_fix()
        == 'AmpPlusPrecision("16-mixed", init_scale=2.0**4, fp32_modules=["pool", "head"])'
    )
    assert fit(Chain(), eval(advice.fix, {"AmpPlusPrecision": AmpPlusPrecision})).history.skipped_steps == []
