"""The documentation's pictures: seeded CPU runs, drawn from their logs by the package's own plot.

    python docs/_figures.py            # writes docs/figures/*.png (a minute on a CPU)

Each picture is a small fit on the CPU, seeded, logged with a ``CSVLogger`` and drawn from that log by
``lightning_amp_plus.plot`` as ``lightning-amp-plus plot`` draws it. Each PNG carries the curves it was drawn from
and the versions it ran on (PNG text chunks): ``tests/test_doc_figures.py`` runs the seeded runs again and checks
that the committed pictures were drawn from what they give now. Run this file again when it says they differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDER = os.path.join(HERE, "figures")
#: the PNG text chunks: the curves a picture was drawn from, and the stack its run ran on
CURVES_KEY = "lightning_amp_plus:curves"
STACK_KEY = "lightning_amp_plus:stack"
MACHINE_KEY = "lightning_amp_plus:machine"


def _model(loss_factor: float = 1.0, optimizer: str = "adamw", lr: float = 1e-3, warmup: int = 0) -> Any:
    """A regression MLP; ``loss_factor`` scales its loss (and so its gradients), ``warmup`` ramps SGD's lr up."""
    import torch
    from lightning.pytorch import LightningModule
    from torch import nn

    class Regression(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y) * loss_factor
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=lr)
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.02, total_iters=warmup)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}

    return Regression()


def _fit(folder: str, steps: int, plugin: Any, model: Callable[[], Any], underflow: bool = False) -> Any:
    """Fit ``model()`` for ``steps`` on the CPU, seeded, logged to a CSVLogger in ``folder``; the curves it logged."""
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_amp_plus import GradUnderflowMonitor, LossScaleCollapseError, LossScaleMonitor, NaNSkipReporter
    from lightning_amp_plus.plot import read_run

    seed_everything(0, verbose=False)  # the weights, the data and its order: whatever ran before in the process
    module = model()
    x = torch.randn(4096, 32)
    loader = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=64, shuffle=True)
    logger = CSVLogger(folder, name="", version="")
    callbacks = [LossScaleMonitor(progress_bar=False), NaNSkipReporter(max_warnings=0)]
    if underflow:
        callbacks.append(GradUnderflowMonitor(every_n_steps=10, max_warnings=0))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[plugin],
        logger=logger,
        log_every_n_steps=10,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with contextlib.suppress(LossScaleCollapseError):  # the collapsing run's end: its last state is logged first
        trainer.fit(module, loader)
    return read_run(logger.log_dir)


def healthy(folder: str) -> Any:
    """The saw-tooth: the scale climbs as the gradients shrink, then each growth into the ceiling overflows once."""
    from lightning_amp_plus import AmpPlusPrecision

    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**3, growth_interval=20)
    return _fit(folder, 500, plugin, lambda: _model(loss_factor=4096.0), underflow=True)


def calibration(folder: str) -> Any:
    """The same run from the default ``init_scale=2**16``: the first updates skipped while the scale comes down."""
    from lightning_amp_plus import AmpPlusPrecision

    plugin = AmpPlusPrecision("16-mixed", growth_interval=20)
    return _fit(folder, 200, plugin, lambda: _model(loss_factor=4096.0))


def collapse(folder: str) -> Any:
    """A learning rate ramped too high: the weights diverge, every update overflows, the scale falls to its floor."""
    from lightning_amp_plus import AmpPlusPrecision

    plugin = AmpPlusPrecision("16-mixed", growth_interval=20)
    return _fit(folder, 300, plugin, lambda: _model(optimizer="sgd", lr=0.6, warmup=200))


def underflow(folder: str) -> Any:
    """Gradients too small for the scale: most of them lost to float16 until the scale has grown to fit them."""
    from lightning_amp_plus import AmpPlusPrecision

    plugin = AmpPlusPrecision("16-mixed", growth_interval=20)
    return _fit(folder, 300, plugin, lambda: _model(loss_factor=1e-8), underflow=True)


#: each picture: its file name (without .png), its title, and the seeded run it is drawn from
FIGURES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "healthy": ("a healthy run: the saw-tooth", healthy),
    "calibration": ("init_scale too high: the first updates skipped", calibration),
    "collapse": ("a collapse: every update overflows", collapse),
    "underflow": ("underflow: gradients below float16's range", underflow),
}


def curves_json(curves: Any) -> str:
    """The curves as JSON (what a PNG carries, and what the test compares)."""
    return json.dumps(dataclasses.asdict(curves), sort_keys=True)


def stack() -> str:
    """What a seeded run's figures depend on: the versions, and the CPU's vector kernels (they round float16)."""
    import lightning
    import torch

    cpu = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}, lightning {lightning.__version__}, cpu {cpu}"


def machine() -> str:
    """The CPU a seeded run ran on: two CPUs with the same vector kernels can still round float16 apart.

    Seen: a loss 16856.396 on one AVX512 CPU, 16856.398 on another (an Intel and an AMD EPYC).
    """
    import platform

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    if "vendor_id" in fields:
        return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{platform.machine()} {platform.processor()}".strip()


def write(name: str, folder: str = FOLDER) -> str:
    """Run ``name``'s seeded fit and draw its curves to ``folder/name.png``; returns the path."""
    from lightning_amp_plus.plot import draw

    title, run = FIGURES[name]
    with tempfile.TemporaryDirectory() as logs:
        curves = run(logs)
    fig = draw(curves, title=title)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.png")
    fig.savefig(path, dpi=72, metadata={CURVES_KEY: curves_json(curves), STACK_KEY: stack(), MACHINE_KEY: machine()})
    return path


def main(names: list[str]) -> None:
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for name in names or list(FIGURES):
        print(write(name))


if __name__ == "__main__":
    main(sys.argv[1:])
