"""Diagnostics on a real Hugging Face GPT-2 (transformers, eager attention, its own key/value cache, dropout 0.1).

At the end, `auto_islands` on BERT, T5 and ViT (transformers): the first feed-forward Linear of layer 0 overflows,
and its float32 output overflows the second; both are found in one run, and the printed fix, pasted, trains.

One layer's projection is scaled so that its float16 output overflows: the watch names that layer from the second
skip on, the run is bit-identical with the reporter and without it, and the advisor's chain of island fixes, pasted
as printed, ends the skips. The opt-in replay draws the dropout masks the step drew, never crashes the run (the
attention appends to the cache the model makes), and measures the islands in one run.
"""

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, NaNSkipReporter
from tests.helpers.trainer import make_trainer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


class GPT2(LightningModule):
    def __init__(self, loud="mlp"):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        config._attn_implementation = "eager"
        self.model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere, use_cache by default
        with torch.no_grad():
            if loud == "mlp":
                self.model.transformer.h[0].mlp.c_fc.weight.mul_(3e5)  # its float16 output overflows
            else:  # layer 1's q.k^T overflows float16 inside its attention, which takes the cache layer 0 filled
                self.model.transformer.h[1].attn.c_attn.weight.mul_(2000.0)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _fit(callbacks, fp32_modules=None, loud="mlp", plugin=None):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (16, 32))
    model = GPT2(loud)
    plugin = plugin or AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0, fp32_modules=fp32_modules)
    make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=6).fit(
        model, DataLoader(TensorDataset(ids), batch_size=2)
    )
    return model, plugin


MLP = "model.transformer.h.0.mlp"


def test_gpt2_origin_watched_without_touching_the_run_and_the_advice_chain_ends_the_skips():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    told, plugin = _fit([reporter])
    plain, _ = _fit([])
    assert plugin.history.num_skipped == 6
    for (name, a), (_, b) in zip(told.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert [r["origin"].get("module") for r in reporter.skips] == [None] + [f"{MLP}.c_fc"] * 5
    fixes = []
    plugin = None
    for _ in range(3):  # each fix pasted as printed, until the run is clean
        advisor = AmpAdvisor(print_advice=False)
        _, plugin = _fit([advisor], plugin=plugin)
        if not plugin.history.num_skipped:
            break
        fixes.append(advisor.advice[0].fix)
        plugin = eval(fixes[-1], {"AmpPlusPrecision": AmpPlusPrecision})
    assert plugin.history.num_skipped == 0
    assert fixes == [  # c_fc in float32 only moves the overflow: c_proj casts its output back to float16
        f'AmpPlusPrecision("16-mixed", init_scale=2.0**0, min_scale=0.0, fp32_modules=["{MLP}.c_fc"])',
        f'AmpPlusPrecision("16-mixed", init_scale=2.0**0, min_scale=0.0, fp32_modules=["{MLP}.c_fc", "{MLP}.c_proj"])',
    ]


def test_gpt2_replay_measures_the_islands_in_one_run():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin="replay")
    _, plugin = _fit([reporter])
    assert plugin.history.num_skipped == 6
    for record in reporter.skips:
        origin = record["origin"]
        assert origin["module"] == f"{MLP}.c_fc", origin  # the dropout masks the step drew: the same overflow
        assert origin["float32"] == "finite"
        assert origin["islands"] == [f"{MLP}.c_fc", f"{MLP}.c_proj"]
    _, fixed = _fit([], fp32_modules=origin["islands"])
    assert fixed.history.num_skipped == 0


def test_gpt2_attention_overflow_is_recomputed_in_float32_with_its_key_value_cache_copied():
    """The attention's `cache` argument (a DynamicCache of non-leaf tensors, which deepcopy refuses) is copied for the
    replay: the verdict is `finite` with its island, not `unknown`, and the island ends the skips."""
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0, find_origin="replay")
    _, plugin = _fit([reporter], loud="attn")
    assert plugin.history.num_skipped == 6
    origins = [r["origin"] for r in reporter.skips]
    attn = "model.transformer.h.1.attn"
    assert all((o["module"], o["float32"], o["islands"]) == (attn, "finite", [attn]) for o in origins), origins
    _, fixed = _fit([], fp32_modules=[attn], loud="attn")
    assert fixed.history.num_skipped == 0


def test_gpt2_auto_islands_find_the_chain_in_one_run_and_nothing_is_born_in_forward_after_the_last():
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0, auto_islands=True)
    _fit([reporter], plugin=plugin)
    assert plugin._auto.added == [f"{MLP}.c_fc", f"{MLP}.c_proj"]  # c_fc's float32 output overflows c_proj: it joins
    assert [r["origin"].get("module") for r in reporter.skips] == [None, f"{MLP}.c_fc", f"{MLP}.c_proj"]
    assert plugin.history.skipped_steps == [0, 1, 2]  # steps 3 to 5 applied: no skip after the last island


class FeedForwardChain(LightningModule):
    """A tiny transformers BERT, T5 or ViT whose layer-0 first feed-forward Linear overflows float16 (a chain: its
    float32 output is beyond float16's range, so the second Linear overflows next)."""

    FIRST = {"bert": "intermediate.dense", "t5": "DenseReluDense.wi", "vit": "mlp.fc1"}

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}  # BERT's and ViT's
        if kind == "bert":
            config = transformers.BertConfig(vocab_size=128, hidden_size=64, max_position_embeddings=64, **tiny)
            config._attn_implementation = "eager"
            self.model = transformers.BertForMaskedLM(config)
        elif kind == "t5":
            config = transformers.T5Config(
                vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
            )
            self.model = transformers.T5ForConditionalGeneration(config)
        else:
            config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_labels=10, **tiny)
            self.model = transformers.ViTForImageClassification(config)
        self.first = next(n for n, _ in self.named_modules() if n.endswith(self.FIRST[kind]))  # layer 0's
        with torch.no_grad():
            self.get_submodule(self.first).weight.mul_(3e5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "vit":
            return self.model(pixel_values=x, labels=y).loss
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _chain_fit(kind, plugin, callbacks=()):
    torch.manual_seed(0)
    if kind == "vit":
        data = TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    else:
        ids = torch.randint(0, 128, (16, 32))
        data = TensorDataset(ids, ids)
    model = FeedForwardChain(kind)
    make_trainer(plugins=[plugin], callbacks=list(callbacks), max_steps=8).fit(model, DataLoader(data, batch_size=2))
    return model


@pytest.mark.parametrize(
    ("kind", "second"),
    [("bert", "output.dense"), ("t5", "DenseReluDense.wo"), ("vit", "mlp.fc2")],
)
def test_auto_islands_find_a_feed_forward_chain_in_one_run_and_the_printed_fix_trains(kind, second):
    reporter = NaNSkipReporter(max_consecutive_skips=None, max_warnings=0)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0, auto_islands=True)
    model = _chain_fit(kind, plugin, [reporter])
    first = model.first
    consumer = first[: -len(FeedForwardChain.FIRST[kind])] + second
    assert plugin._auto.added == [first, consumer]  # the first's float32 output overflows the second: it joins
    assert [r["origin"].get("module") for r in reporter.skips] == [None, first, consumer]
    assert plugin.history.skipped_steps == [0, 1, 2]  # steps 3 to 7 applied: nothing born in forward after
    fix = plugin.auto_islands_fix()
    assert fix is not None
    assert f'fp32_modules=["{first}", "{consumer}"]' in fix
    plain = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=0.0)
    _chain_fit(kind, plain)
    assert plain.history.num_skipped == 8  # without islands every update skips
    pasted = eval(fix, {"AmpPlusPrecision": AmpPlusPrecision})
    _chain_fit(kind, pasted)
    assert pasted.history.num_skipped == 0  # the printed fix, pasted, trains from its first step
