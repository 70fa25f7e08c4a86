"""Gradient accumulation under AmpPlusPrecision: gradients unscaled once, on the stepping batch, then clipped.

python examples/grad_accumulation.py [--steps 50] [--accumulate 4] [--out runs/accumulation] [--fast]
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=4, help="batches accumulated into each optimizer step")
    parser.add_argument("--out", default="runs/accumulation", help="folder for the CSV logs")
    parser.add_argument("--fast", action="store_true", help="3 optimizer steps (the test suite's smoke test)")
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
        self.grad_norms: list[float] = []
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # a true (unscaled) norm of the accumulated gradients, as a logger would want it
        norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in self.parameters()])
        self.grad_norms.append(float(torch.linalg.vector_norm(norms)))  # the true gradients' global norm

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> Regressor:
    args = parser().parse_args(argv)
    seed_everything(0)
    x = torch.randn(2048, 32)
    loader = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=16)
    model = Regressor()
    plugin = AmpPlusPrecision("16-mixed")
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        plugins=[plugin],
        max_steps=3 if args.fast else args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[LossScaleMonitor(), NaNSkipReporter()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    window = max(1, min(args.accumulate * 4, len(model.losses) // 4))
    first, last = sum(model.losses[:window]) / window, sum(model.losses[-window:]) / window
    print(
        f"optimizer steps: {trainer.global_step} over {trainer.global_step * args.accumulate} batches;"
        f" true grad norms (first 3): {[round(n, 3) for n in model.grad_norms[:3]]}; loss scale {plugin.loss_scale:g};"
        f" loss {first:.3f} -> {last:.3f} (mean of the first and last {window} batches)"
    )
    return model


if __name__ == "__main__":
    main()
