"""Two optimizers in manual optimization (a GAN-style loop) under AmpPlusPrecision.

The scaler updates once per batch, after the last optimizer step: an overflow in the discriminator's step backs the
scale off once, and the generator's gradients are unscaled with the scale they were scaled with.

    python examples/gan_manual.py [--steps 200] [--out runs/gan] [--fast]
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="batches (each steps both optimizers)")
    parser.add_argument("--out", default="runs/gan", help="folder for the CSV logs")
    parser.add_argument("--fast", action="store_true", help="4 batches (the test suite's smoke test)")
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter


class GAN(LightningModule):
    def __init__(self, latent: int = 8, dim: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, dim))
        self.discriminator = nn.Sequential(nn.Linear(dim, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.latent = latent
        self.gaps: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        z = torch.randn(real.shape[0], self.latent, device=real.device)
        fake = self.generator(z)
        # discriminator
        opt_d.zero_grad()
        d_loss = bce(self.discriminator(real).float(), torch.ones(real.shape[0], 1, device=real.device)) + bce(
            self.discriminator(fake.detach()).float(), torch.zeros(real.shape[0], 1, device=real.device)
        )
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")  # true gradients
        opt_d.step()
        # generator
        opt_g.zero_grad()
        g_loss = bce(self.discriminator(fake).float(), torch.ones(real.shape[0], 1, device=real.device))
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        # how far the generated samples are from the real distribution's mean: what "learning" means here
        self.gaps.append(float((fake.detach().float().mean(0) - real.float().mean(0)).norm()))

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        )


def main(argv: list[str] | None = None) -> AmpPlusPrecision:
    args = parser().parse_args(argv)
    seed_everything(0)
    real = torch.randn(4096, 2) * 0.5 + torch.tensor([2.0, -1.0])
    loader = DataLoader(TensorDataset(real), batch_size=64, shuffle=True)
    plugin = AmpPlusPrecision("16-mixed", growth_interval=50)
    batches = 4 if args.fast else args.steps
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        plugins=[plugin],
        max_steps=2 * batches,  # Lightning counts each optimizer's step
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[LossScaleMonitor(), NaNSkipReporter()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GAN()
    trainer.fit(model, loader)
    window = max(1, min(20, len(model.gaps) // 4))
    first, last = sum(model.gaps[:window]) / window, sum(model.gaps[-window:]) / window
    print(f"gap between generated and real means: {first:.3f} -> {last:.3f} (first and last {window} batches)")
    print(
        f"optimizer steps (global_step): {trainer.global_step}; updates (loss-scale cycles, one per batch):"
        f" {plugin.history.num_steps}, applied {plugin.applied_steps}, skipped at step (the logger's)"
        f" {plugin.history.skipped_steps}; loss scale {plugin.loss_scale:g}"
    )
    return plugin


if __name__ == "__main__":
    main()
