"""FSDP1 (Lightning FSDPStrategy) and FSDP2 (ModelParallelStrategy + fully_shard) on CPU: 2 processes, gloo."""

import json
import math

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from lightning_amp_plus import AmpPlusFSDPPrecision, AmpPlusPrecision, ShardedDynamicLossScaler
from tests.helpers.sharded import run_script

FSDP1 = r'''
import json, math, sys
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_amp_plus import AmpPlusFSDPPrecision, GradUnderflowMonitor, LossScaleMonitor, NaNSkipReporter
from tests.helpers.listeners import listener
from tests.helpers.models import TinyModel
from tests.helpers.sharded import CPUFSDPStrategy

out, mode = sys.argv[1], sys.argv[2]
model = None
POISON = {2, 5, 6, 10}


class ShardPoison(TinyModel):
    """An inf in one element of rank 1's own shard of `net.0.bias` (rank 0 holds none of it)."""

    def __init__(self):
        super().__init__(lr=1e-3, optimizer="adam")  # stateful: torch cannot load an empty sharded optimizer state
        self.local = {}
        self.norms = []

    def on_after_backward(self):
        super().on_after_backward()
        for name, p in self.named_parameters():
            self.local[name] = 0 if p.grad is None else p.grad.numel()
        if self.global_rank == 1 and self.trainer.global_step in POISON:
            grad = dict(self.named_parameters())["net.0.bias"].grad
            grad.view(-1)[0] = float("inf")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        local = sum(float(p.grad.double().pow(2).sum()) for p in self.parameters() if p.grad is not None)
        total = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(total)
        self.norms.append(math.sqrt(float(total)))


seen = []


def record_local(optimizer, step):  # runs right after the monitor measured: this rank's part of its figures
    if (step + 1) % 2:  # the monitor measures on Lightning's logging steps (1, 3, ...)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    seen.append({
        "step": step,
        "zeros": sum(int((g == 0).sum()) for g in grads),
        "small": sum(int(((g != 0) & (g.abs() < 2.0**-14)).sum()) for g in grads),
        "numel": sum(g.numel() for g in grads),
        "max": max([float(g.abs().max()) for g in grads], default=0.0),
    })


def make(steps, ckpt=None, every=None):
    global model
    plugin = AmpPlusFSDPPrecision("16-mixed", init_scale=2.0**10, growth_interval=3, hysteresis=2)
    reporter = NaNSkipReporter(max_warnings=5)
    underflow = GradUnderflowMonitor(every_n_steps=2)
    monitor = LossScaleMonitor(logging_interval=3)
    callbacks = [monitor, reporter, underflow]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=every, save_top_k=-1))
    model = ShardPoison()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=[plugin], max_steps=steps,
        gradient_clip_val=0.05, logger=CSVLogger(out, name="logs"), callbacks=callbacks,
        enable_checkpointing=bool(every), enable_progress_bar=False, enable_model_summary=False,
    )
    plugin.listen(listener(before_unscale=record_local))
    return trainer, plugin, reporter, underflow, monitor


def dump(name, trainer, plugin, reporter, underflow, monitor):
    with open(f"{out}/{name}{trainer.global_rank}.json", "w") as f:
        json.dump({
            "curve": plugin.history.curve(), "skipped": plugin.history.skipped_steps,
            "scaler": plugin.scaler.state_dict(), "applied": plugin.applied_steps, "skips": reporter.skips,
            "norms": model.norms, "local": model.local, "underflow": underflow.measurements, "seen": seen,
            "params": [float(p.detach().double().sum()) for p in model.parameters()],
            "consecutive": reporter.state_dict()["consecutive"], "monitor": monitor.state_dict(),
        }, f)


if mode == "fit":
    parts = make(9)
    parts[0].fit(model)
    dump("rank", *parts)
elif mode == "resume":
    parts = make(12, every=8)  # 8 batches a rank an epoch: a checkpoint at the epoch boundary
    parts[0].fit(model)
    dump("full", *parts)
    seen.clear()
    parts = make(12)
    parts[0].fit(model, ckpt_path=f"{out}/ckpt/epoch=0-step=8.ckpt")
    dump("rank", *parts)
elif mode == "syncs":
    from lightning_amp_plus.syncs import HostSyncCounter

    counts = {}
    for name in ("ours", "stock-32"):
        for steps in (4, 8):
            plugins = [AmpPlusFSDPPrecision("16-mixed", init_scale=2.0**10)] if name == "ours" else []
            model = TinyModel()
            trainer = Trainer(
                accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=plugins, max_steps=steps,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )
            with HostSyncCounter() as counter:
                trainer.fit(model)
            counts.setdefault(name, []).append(counter.count)
    with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
        json.dump({name: (c[1] - c[0]) / 4 for name, c in counts.items()}, f)

from tests.helpers.sharded import leave  # noqa: E402

leave()
'''


def _reference_scales(steps, overflows, init, interval, hysteresis):
    scale, growth, hyst, out = init, 0, hysteresis, []
    for step in range(steps):
        out.append(scale)
        if step in overflows:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale, hyst = scale / 2, 0
        else:
            growth += 1
            if growth == interval:
                growth, hyst, scale = 0, hysteresis, scale * 2
    return out


@pytest.mark.slow
def test_fsdp1_overflow_in_one_ranks_shard_skips_everywhere(tmp_path):
    zero, one = run_script(FSDP1, tmp_path, "fit")
    # the underflow figures are the whole model's: this rank's shard plus the other's, identical on both ranks
    for measured, mine, theirs in zip(zero["underflow"], zero["seen"], one["seen"], strict=True):
        assert measured["step"] == mine["step"] == theirs["step"]
        total = mine["numel"] + theirs["numel"]
        zeros = mine["zeros"] + theirs["zeros"]
        fraction = (mine["small"] + theirs["small"]) / (total - zeros)
        assert measured["zero_fraction"] == pytest.approx(zeros / total, rel=1e-9)
        assert measured["reference"] is None  # sharded: no float32 reference, the lower-bound figure
        largest = max(mine["max"], theirs["max"])
        if math.isfinite(largest):
            assert measured["underflow_fraction"] == pytest.approx(fraction, rel=1e-9)
            assert measured["headroom_bits"] == pytest.approx(math.log2(65504.0 / largest))
        else:  # the poisoned step, seen on rank 1 only: no headroom and no fraction on either rank
            assert measured["headroom_bits"] is None
            assert measured["underflow_fraction"] is None
    assert zero["local"]["net.0.bias"] == 0  # rank 0 holds none of the poisoned parameter
    assert one["local"]["net.0.bias"] > 0
    for key in ("curve", "skipped", "scaler", "applied", "skips", "underflow"):
        assert zero[key] == one[key], key
    assert zero["skipped"] == [2, 5, 6]
    assert zero["applied"] == 6
    scales = _reference_scales(9, {2, 5, 6}, 1024.0, 3, 2)
    curve = dict(zero["curve"])
    assert all(scales[s] == v for s, v in curve.items())
    assert [r["step"] for r in zero["skips"]] == [2, 5, 6]
    assert [o["name"] for o in zero["skips"][0]["offenders"]] == ["net.0.bias"]  # named on every rank
    offender = zero["skips"][0]["offenders"][0]
    assert offender["inf"] + offender["nan"] == 1  # the one poisoned element (clipping by an inf norm makes it nan)
    assert 0 < zero["skips"][0]["loss"] < 10  # hooks saw the true loss (scaled once, after them)
    # sharded: no module watched, the phase read from the loss (finite) on every rank
    assert (
        "step 2 skipped: born in backward (the loss was finite); gradients non-finite in net.0.bias (1 "
        in zero["_stderr"]
    )
    assert zero["_stderr"].count("step 2 skipped") == 1  # from rank zero only
    # clipping clipped the global norm over both shards to 0.05 on every applied step
    applied = [n for i, n in enumerate(zero["norms"]) if i not in (2, 5, 6)]
    assert all(n == pytest.approx(0.05, rel=1e-3) for n in applied)
    assert zero["norms"] == one["norms"]


def test_fsdp_strategy_accepts_the_plugin_and_names_are_exported():
    plugin = AmpPlusFSDPPrecision("16-mixed", growth_interval=100)
    assert FSDPStrategy(precision_plugin=plugin).precision_plugin is plugin
    assert isinstance(plugin, AmpPlusPrecision)
    assert isinstance(plugin.scaler, ShardedDynamicLossScaler)
    assert plugin.scaler.get_growth_interval() == 100
    config = plugin.mixed_precision_config  # float32 parameters and reduction: autocast does the fp16 compute
    assert (str(config.param_dtype), str(config.reduce_dtype)) == ("torch.float32", "torch.float32")
    config = AmpPlusFSDPPrecision("bf16-mixed", param_dtype="bfloat16", reduce_dtype="float32").mixed_precision_config
    assert (str(config.param_dtype), str(config.reduce_dtype)) == ("torch.bfloat16", "torch.float32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": "fp16"}, r"`AmpPlusFSDPPrecision\(param_dtype='fp16'\)` is invalid: expected one of"),
        ({"reduce_dtype": 16}, r"`AmpPlusFSDPPrecision\(reduce_dtype=16\)` is invalid"),
        ({"init_scale": 0.0}, r"`AmpPlusFSDPPrecision\(init_scale=0.0\)` is invalid"),
    ],
)
def test_fsdp_plugin_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AmpPlusFSDPPrecision("16-mixed", **kwargs)


@pytest.mark.slow
def test_fsdp1_sharded_checkpoint_resumes_exactly(tmp_path):
    runs = run_script(FSDP1, tmp_path, "resume")
    for rank, resumed in enumerate(runs):
        with open(tmp_path / f"full{rank}.json") as f:
            full = json.load(f)
        assert resumed["params"] == full["params"]  # this rank's shards, bit for bit
        for key in ("curve", "skipped", "scaler", "applied", "consecutive", "monitor"):
            assert resumed[key] == full[key], key
        assert [r["step"] for r in resumed["skips"]] == [2, 5, 6, 10]
    assert (tmp_path / "ckpt" / "epoch=0-step=8.ckpt").is_dir()  # a sharded checkpoint


@pytest.mark.slow
def test_fsdp1_costs_one_host_sync_per_step(tmp_path):
    zero, one = run_script(FSDP1, tmp_path, "syncs")
    del zero["_stderr"]
    # beyond what FSDP itself costs per step: one, the skip decision torch needs (the flag's reduction is on device)
    assert zero == one
    assert zero["ours"] - zero["stock-32"] == 1.0


FSDP2 = r"""
import json, math, sys
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_amp_plus import AmpPlusPrecision, GradUnderflowMonitor, LossScaleMonitor, NaNSkipReporter
from tests.helpers.models import TinyModel

out = sys.argv[1]
POISON = {1, 4}


class Sharded(TinyModel):
    def __init__(self):
        super().__init__(lr=1e-3, optimizer="adam")
        self.local = {}
        self.norms = []

    def configure_model(self):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6 has it here
            from torch.distributed._composable.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if list(layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def on_after_backward(self):
        super().on_after_backward()
        for name, p in self.named_parameters():
            self.local[name] = 0 if p.grad is None else p.grad.to_local().numel()
        if self.global_rank == 1 and self.trainer.global_step in POISON:
            dict(self.named_parameters())["net.0.bias"].grad.to_local().view(-1)[0] = float("inf")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        local = sum(float(p.grad.to_local().double().pow(2).sum()) for p in self.parameters() if p.grad is not None)
        total = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(total)
        self.norms.append(math.sqrt(float(total)))


plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, growth_interval=3, hysteresis=2)
reporter = NaNSkipReporter(max_warnings=5)
underflow = GradUnderflowMonitor(every_n_steps=1)
model = Sharded()
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
trainer = Trainer(
    accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], max_steps=6, gradient_clip_val=0.05,
    logger=False, callbacks=[reporter, underflow], enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model)
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({
        "curve": plugin.history.curve(), "skipped": plugin.history.skipped_steps, "skips": reporter.skips,
        "underflow": underflow.measurements, "local": model.local, "norms": model.norms,
        "scaler": plugin.scaler.state_dict(),
    }, f)

from tests.helpers.sharded import leave  # noqa: E402

leave()
"""


@pytest.mark.slow
@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 6),
    reason="FSDP2 before torch 2.6 creates CUDA streams unconditionally: it cannot run on CPU",
)
def test_fsdp2_fully_shard_skips_names_and_measures_across_shards(tmp_path):
    zero, one = run_script(FSDP2, tmp_path, "fit")
    assert zero["local"]["net.2.bias"] + one["local"]["net.2.bias"] == 1  # one rank's local shard is empty
    for key in ("curve", "skipped", "skips", "underflow", "scaler", "norms"):
        assert zero[key] == one[key], key
    assert zero["skipped"] == [1, 4]
    assert [o["name"] for o in zero["skips"][0]["offenders"]] == ["net.0.bias"]  # not "<unnamed (8,)>"
    assert len(zero["underflow"]) == 6  # measured every step, the empty shard included
    applied = [n for i, n in enumerate(zero["norms"]) if i not in (1, 4)]
    assert all(n == pytest.approx(0.05, rel=1e-3) for n in applied)  # the global norm, clipped


def test_fsdp_plugin_hands_on_every_argument():
    """device, the FSDP dtypes and the scaler knobs each reach what uses them, and the repr shows what was given."""
    assert AmpPlusFSDPPrecision().precision == "16-mixed"
    plugin = AmpPlusFSDPPrecision(
        "16-mixed", device="cpu", param_dtype="float16", reduce_dtype="bfloat16", growth_interval=5
    )
    assert plugin.device == "cpu"
    assert plugin.scaler.get_growth_interval() == 5
    config = plugin.mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype) == (torch.float16, torch.bfloat16)
    assert repr(plugin) == (
        "AmpPlusFSDPPrecision(device='cpu', param_dtype='float16', reduce_dtype='bfloat16', growth_interval=5)"
    )
    # FSDPPrecision's input rule: floating inputs reach the model in float32 (autocast casts per op)
    assert plugin.convert_input(torch.ones(2, dtype=torch.float64)).dtype == torch.float32
    assert plugin.convert_input(torch.ones(2, dtype=torch.int64)).dtype == torch.int64


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_only_the_sharded_plugin_reduces_the_skip_flag_over_the_ranks(monkeypatch, precision):
    """The other rank overflowed: FSDP's plugin (each rank holds a shard) skips; the plain plugin and Fabric's, whose
    ranks hold whole gradients, never reduce the flag."""
    from lightning_amp_plus import AmpPlusFabricPrecision
    from tests.helpers.sharded import FakePeer

    peer = FakePeer(monkeypatch, lambda tensor, op: torch.ones_like(tensor))
    for make, sharded in ((AmpPlusFSDPPrecision, True), (AmpPlusPrecision, False), (AmpPlusFabricPrecision, False)):
        engine = make(precision, device="cpu").engine
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        peer.calls.clear()
        engine.scale(model(torch.ones(1, 2)).sum()).backward()
        engine.begin(opt, 0)
        engine.step(opt)
        engine.end_cycle()
        assert (engine.step_was_skipped(opt), bool(peer.calls)) == (sharded, sharded), make.__name__
