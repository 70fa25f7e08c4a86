"""DDP on CPU (gloo, 2 processes): a skip on one rank is a skip on every rank; output from rank zero only."""

import json
import logging
import pickle
import warnings

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter
from tests.helpers.models import RankPoisonModel
from tests.helpers.sharded import ExitWithoutFinalizing
from tests.helpers.trainer import make_trainer


class Dump(Callback):
    """Each rank writes its parameters, history and the warnings it emitted to ``folder/rank{N}.pkl``."""

    def __init__(self, folder):
        self.folder = str(folder)

    def setup(self, trainer, pl_module, stage):
        self.warned = []  # warnings and the package's console lines (logger "lightning_amp_plus")
        original = warnings.showwarning

        def record(message, *args, **kwargs):
            self.warned.append(str(message))
            return original(message, *args, **kwargs)

        warnings.showwarning = record
        warnings.simplefilter("always")
        warned = self.warned

        class Lines(logging.Handler):
            def emit(self, record):
                warned.append(record.getMessage())

        logging.getLogger("lightning_amp_plus").addHandler(Lines())

    def on_train_end(self, trainer, pl_module):
        plugin = trainer.precision_plugin
        reporter = next(c for c in trainer.callbacks if isinstance(c, NaNSkipReporter))
        out = {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "history": plugin.history.state_dict(),
            "scaler": plugin.scaler.state_dict(),
            "skips": [r["step"] for r in reporter.skips],
        }
        with open(f"{self.folder}/rank{trainer.global_rank}.pkl", "wb") as f:
            pickle.dump(out, f)

    def teardown(self, trainer, pl_module, stage):
        with open(f"{self.folder}/rank{trainer.global_rank}.warn", "wb") as f:
            pickle.dump(self.warned, f)


@pytest.mark.slow
def test_ddp_overflow_on_one_rank_skips_everywhere(tmp_path):
    model = RankPoisonModel(poison_rank=1, poison={2: "inf", 5: "nan"})
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    report = tmp_path / "skips.json"
    trainer = make_trainer(
        strategy="ddp_spawn",
        devices=2,
        plugins=[plugin],
        callbacks=[
            LossScaleMonitor(logging_interval=2),
            NaNSkipReporter(report_path=report),
            Dump(tmp_path),
            ExitWithoutFinalizing(),
        ],
        logger=CSVLogger(tmp_path, name="ddp"),
        max_steps=7,
    )
    trainer.fit(model)
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    zero, one = ranks
    for name in zero["params"]:
        assert torch.equal(zero["params"][name], one["params"][name])
    assert zero["history"] == one["history"]
    assert zero["history"]["skipped_steps"] == [2, 5]
    assert zero["scaler"] == one["scaler"]
    assert zero["skips"] == one["skips"] == [2, 5]
    # output from rank zero only: the skip lines, the JSON report and the CSV metrics
    warned = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.warn", "rb") as f:
            warned.append([w for w in pickle.load(f) if "skipped" in w])
    assert any(w.startswith("step 2 skipped") for w in warned[0])
    assert warned[1] == []
    assert json.loads(report.read_text())["skipped_steps"] == [2, 5]
    metrics = (tmp_path / "ddp" / "version_0" / "metrics.csv").read_text()
    assert "amp/loss_scale" in metrics


def test_fsdp_is_refused_with_a_message_naming_the_plugin_it_needs():
    # FSDP shards gradients, so the overflow flag must be reduced across ranks: Lightning's FSDP strategy accepts
    # only FSDPPrecision instances, and AmpPlusFSDPPrecision is one (tests/test_fsdp.py); the plain plugin is refused.
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        FSDPStrategy(precision_plugin=AmpPlusPrecision("16-mixed"))


@pytest.mark.requires_cuda
def test_fsdp_trainer_is_refused_on_cuda():
    with pytest.raises(TypeError, match="FSDPPrecision"):
        make_trainer(strategy="fsdp", accelerator="cuda", devices=1, plugins=[AmpPlusPrecision("16-mixed")])


DDP_SCRIPT = """
import json, sys
import torch
from lightning.pytorch import Trainer
from lightning_amp_plus import AmpPlusPrecision, NaNSkipReporter
from tests.helpers.models import RankPoisonModel

out = sys.argv[1]
model = RankPoisonModel(poison_rank=1, poison={1: "inf"})
plugin = AmpPlusPrecision("16-mixed", init_scale=512.0)
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_steps=4, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[NaNSkipReporter(max_warnings=0)])
trainer.fit(model)
checksum = float(sum(p.double().sum() for p in model.parameters()))
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({"skipped": plugin.history.skipped_steps, "scale": plugin.loss_scale, "checksum": checksum}, f)

from tests.helpers.sharded import leave  # noqa: E402

leave()
"""


@pytest.mark.slow
def test_ddp_subprocess_launcher(tmp_path):
    """`strategy="ddp"` as users run it: Lightning re-launches the script for rank 1."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=root, env=env, check=True, timeout=300, capture_output=True
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["skipped"] == [1]
    assert ranks[0]["scale"] == 256.0


class RankBatchPoison(RankPoisonModel):
    """NaN in rank 1's batch at the poisoned steps (as the data loader handed it in)."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_rank == self.poison_rank and self.trainer.global_step in self.rank_poison:
            batch[0][0, 0] = float("nan")


class Advice(Callback):
    """Rank zero writes the reporter's origins and the advisor's codes (after the advisor's own end of training)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def on_train_end(self, trainer, pl_module):
        from lightning_amp_plus import AmpAdvisor

        if trainer.global_rank != 0:
            return
        advisor = next(c for c in trainer.callbacks if isinstance(c, AmpAdvisor))
        reporter = next(c for c in trainer.callbacks if isinstance(c, NaNSkipReporter))
        out = {"origins": [r["origin"] for r in reporter.skips], "codes": [a.code for a in advisor.advice]}
        with open(f"{self.folder}/advice.json", "w") as f:
            json.dump(out, f)


@pytest.mark.slow
def test_ddp_the_origin_is_the_jobs_not_rank_zeros(tmp_path):
    from lightning_amp_plus import AmpAdvisor

    model = RankBatchPoison(poison_rank=1, poison={2: "nan", 4: "nan", 6: "nan"})
    report = tmp_path / "skips.json"
    trainer = make_trainer(
        strategy="ddp_spawn",
        devices=2,
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[
            NaNSkipReporter(report_path=report, max_warnings=0),
            AmpAdvisor(print_advice=False),
            Advice(tmp_path),
            ExitWithoutFinalizing(),
        ],
        max_steps=8,
    )
    trainer.fit(model)
    skips = json.loads(report.read_text())["skips"]
    first = {"phase": "input", "reason": "every module is watched from the next step", "rank": 1}  # both ranks watch
    watched = {"phase": "input", "rank": 1}
    assert [(r["step"], r["origin"]) for r in skips] == [(2, first), (4, watched), (6, watched)]
    told = json.loads((tmp_path / "advice.json").read_text())
    assert told["origins"] == [first, watched, watched]  # rank 0's batch was finite: it could not tell
    assert told["codes"][0] == "nonfinite_loss"  # the batch, not init_scale or bf16
    assert "init_scale" not in told["codes"]


@pytest.mark.slow
def test_ddp_checkpoint_saves_a_fused_optimizers_skips_with_their_origins(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = RankPoisonModel(poison_rank=1, poison={1: "inf"}, optimizer="fused_sgd")
    trainer = make_trainer(
        strategy="ddp_spawn",
        devices=2,
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)],
        callbacks=[
            NaNSkipReporter(max_warnings=0),
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1),
            ExitWithoutFinalizing(),
        ],
        max_steps=4,
        enable_checkpointing=True,
    )
    trainer.fit(model)  # every rank reads the device flags as the state is saved: none waits for another
    (first,) = list(tmp_path.glob("*step=2*.ckpt"))  # saved at step 2, one after the skip
    saved = torch.load(first, weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("NaNSkipReporter")]
    skips = {r["step"]: r["origin"] for r in [*state["head"], *state["tail"]]}
    # read before saving, with its origin (rank zero's own reading: a fused skip's is not gathered over ranks)
    assert skips[1] == {"phase": "backward"}
