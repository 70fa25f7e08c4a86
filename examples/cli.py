"""LightningCLI entry point for ``examples/config.yaml``.

Needs the ``[cli]`` extra (jsonargparse): ``pip install -e ".[cli]"``.

python examples/cli.py fit --config examples/config.yaml
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class CLIModel(LightningModule):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def on_fit_end(self) -> None:
        window = max(1, min(20, len(self.losses) // 4))
        first, last = sum(self.losses[:window]) / window, sum(self.losses[-window:]) / window
        print(f"loss {first:.3f} -> {last:.3f} (mean of the first and last {window} steps)")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 16, generator=g)
        return DataLoader(TensorDataset(x, 0.25 * x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(CLIModel, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
