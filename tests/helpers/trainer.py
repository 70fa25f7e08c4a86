"""Trainer factory and probes shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_amp_plus import (
    AmpAdvisor,
    GradUnderflowMonitor,
    LossScaleMonitor,
    NaNSkipReporter,
    PrecisionReport,
)

#: each of our callbacks at its defaults, alone and all together: what must leave a run bit for bit as without them
AT_DEFAULTS: dict[str, Any] = {
    "LossScaleMonitor": lambda: [LossScaleMonitor()],
    "NaNSkipReporter": lambda: [NaNSkipReporter()],
    "GradUnderflowMonitor": lambda: [GradUnderflowMonitor()],
    "PrecisionReport": lambda: [PrecisionReport()],
    "AmpAdvisor": lambda: [AmpAdvisor()],
    "all": lambda: [LossScaleMonitor(), NaNSkipReporter(), GradUnderflowMonitor(), PrecisionReport(), AmpAdvisor()],
}


def watched_fit(make_model: Any, loader: Any, max_steps: int, **plugin: Any) -> tuple[NaNSkipReporter, AmpAdvisor]:
    """A 16-mixed fit watched from its first step, with the advisor: what they told. ``make_model`` is called after
    the seed (0), so the model's weights do not depend on the tests before."""
    from lightning_amp_plus import AmpPlusPrecision

    reporter = NaNSkipReporter(find_origin="watch", quiet=True, max_consecutive_skips=None)
    advisor = AmpAdvisor(print_advice=False)
    torch.manual_seed(0)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", **plugin)], callbacks=[reporter, advisor], max_steps=max_steps
    ).fit(make_model(), loader)
    return reporter, advisor


def make_trainer(**kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=8,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def snapshot(module: LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    return {"params": params, "state": state}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["params"].keys() != b["params"].keys():
        return False
    for n in a["params"]:
        if not torch.equal(a["params"][n], b["params"][n]):
            return False
    if a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        for key, v in a["state"][k].items():
            w = b["state"][k][key]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


class StepProbe(Callback):
    """Snapshots parameters and optimizer state around every batch; records which batches changed nothing."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, Any]] = {}
        self.unchanged: list[int] = []
        self.changed: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.before[trainer.global_step] = snapshot(pl_module, trainer.optimizers[0])
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        after = snapshot(pl_module, trainer.optimizers[0])
        (self.unchanged if same(self.before[self._step], after) else self.changed).append(self._step)
