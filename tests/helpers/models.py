"""Tiny models for real Trainer runs on CPU, with fault injection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together (``torch.nn.utils.get_total_norm`` exists from torch 2.6 only)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))


def make_loader(n: int = 64, batch_size: int = 4, seed: int = 0, features: int = 8) -> DataLoader:
    """A deterministic regression data set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TinyModel(LightningModule):
    """A two-layer MLP; ``poison`` maps a global step to ``"inf"``/``"nan"`` to multiply that step's loss by it.

    ``grad_poison`` maps a global step to a parameter name whose gradient gets an inf at that step.
    """

    def __init__(
        self,
        poison: Optional[dict[int, str]] = None,
        grad_poison: Optional[dict[int, str]] = None,
        lr: float = 0.1,
        optimizer: str = "sgd",
        scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
        features: int = 8,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))
        self.poison = poison or {}
        self.grad_poison = grad_poison or {}
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.seen_grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self._handles: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out.float(), y)
        kind = self.poison.get(self.trainer.global_step)
        if kind is not None:
            loss = loss * float(kind)
        name = self.grad_poison.get(self.trainer.global_step)
        if name is not None:
            param = dict(self.named_parameters())[name]
            handle = param.register_hook(lambda g: g * float("inf"))
            self._handles.append(handle)
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "fused_adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        elif self.optimizer_name == "fused_sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)
        elif self.optimizer_name == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler(opt), "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return make_loader()


class RankPoisonModel(TinyModel):
    """Poisons the loss on one rank only (``poison_rank``) at the steps in ``poison``."""

    def __init__(self, poison_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.poison_rank = poison_rank
        self.rank_poison = dict(self.poison)
        self.poison = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.poison = self.rank_poison if self.global_rank == self.poison_rank else {}
        return super().training_step(batch, batch_idx)


def loud_batches(steps: int, loud: tuple[int, ...], scale: float, features: int = 8) -> DataLoader:
    """Batches of 4 random rows (seed 0), those of the batches in ``loud`` times ``scale``; targets their sums / 100."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 4, features, generator=g)
    for step in loud:
        x[step * 4 : step * 4 + 4] *= scale
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.01), batch_size=4)


class SentinelRouter(nn.Module):
    """Returns the gate it routes with and its scores with +inf where it masks (its own sentinel): a step that uses
    the gate only never uses the sentinel."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        scores = self.lin(x)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[:, 1] = True
        return torch.softmax(scores.float(), -1), scores.masked_fill(mask, float("inf"))
