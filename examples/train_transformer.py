"""Main example: a small Transformer language model trained in fp16 on CPU (or GPU) with AmpPlusPrecision.

AdamW (lr 1e-3) with linear warmup, gradient clipping, LossScaleMonitor (the scale in the progress bar) and
NaNSkipReporter. The scale starts high (``init_scale=2**24``) and calibrates down in the first steps, each overflow
skipped and named; the run ends by printing the loss before and after and writing the scale-curve PNG (the curve,
the skipped steps marked, the loss below). 21-26 s on a 2-core CPU with ``OMP_NUM_THREADS=1`` (docs, Performance);
``--fast`` runs a few steps.

    python examples/train_transformer.py [--steps 300] [--out runs/transformer] [--fast]
"""

from __future__ import annotations

import argparse
import math
import os


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps (optimizer updates)")
    parser.add_argument(
        "--out", default="runs/transformer", help="folder for the CSV logs, skips.json, advice.md and the PNG"
    )
    parser.add_argument(
        "--precision",
        default="16-mixed",
        choices=["16-mixed", "bf16-mixed"],
        help="16-mixed: float16 with loss scaling (starting at 2**24); bf16-mixed: bfloat16, no loss scale",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate after its linear warmup")
    parser.add_argument("--fast", action="store_true", help="6 steps, no progress bar (the test suite's smoke test)")
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpAdvisor, AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter, plot_run


def make_data(vocab: int, seq: int, n: int, seed: int = 0) -> TensorDataset:
    """Sequences of a noisy repeating pattern: learnable, deterministic."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + step * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class TinyTransformer(LightningModule):
    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2, lr: float = 1e-3, warmup: int = 30) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 64, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)  # norm_first has no fast path
        self.head = nn.Linear(dim, vocab)
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.pos[:, :seq], mask=mask, is_causal=True)
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=self.hparams.warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    steps = 6 if args.fast else args.steps
    seed_everything(0)
    data = make_data(vocab=64, seq=32, n=2048)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model = TinyTransformer(lr=args.lr, warmup=min(30, steps))
    # a deliberately high first scale: watch it calibrate down (each overflowing step skipped), then grow back
    scaler_knobs = {"init_scale": 2.0**24, "growth_interval": 100} if args.precision == "16-mixed" else {}
    plugin = AmpPlusPrecision(args.precision, **scaler_knobs)
    logger = CSVLogger(args.out, name="logs")
    # what went wrong and the fix: printed below, after the figures, and written as Markdown
    advisor = AmpAdvisor(report_path=os.path.join(args.out, "advice.md"), print_advice=False)
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        plugins=[plugin],
        max_steps=steps,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=logger,
        callbacks=[
            LossScaleMonitor(),
            NaNSkipReporter(report_path=os.path.join(args.out, "skips.json")),
            advisor,
        ],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.fast,
    )
    trainer.fit(model, loader)
    history = plugin.history
    window = max(1, min(20, len(model.losses) // 4))
    first, last = sum(model.losses[:window]) / window, sum(model.losses[-window:]) / window
    print(
        f"steps: {history.num_steps}, applied: {plugin.applied_steps}, skipped: {history.skipped_steps},"
        f" final loss scale: {plugin.loss_scale:.10g} (2^{math.log2(plugin.loss_scale):.0f});"
        f" loss {first:.3f} -> {last:.3f} (mean of the first and last {window} steps)"
    )
    png = plot_run(logger.log_dir, os.path.join(args.out, "loss_scale.png"))
    print(f"scale curve written to {png}")
    print(advisor.format())
    return png


if __name__ == "__main__":
    main()
