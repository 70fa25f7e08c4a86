"""Sharded training (FSDP) under AmpPlusFSDPPrecision: the same scaler, history, clipping and reports as one device.

Runs on 2 CPU processes (gloo) when there is no GPU, on every GPU otherwise:

    python examples/fsdp.py [--steps 60] [--devices 2] [--out runs/fsdp] [--fast]

An inf lands in one element of the last rank's own gradient shard at a few steps: every rank skips those steps,
the reporter names the parameter once (from rank zero), and the scale curve is identical on every rank.
"""

from __future__ import annotations

import argparse
from typing import Any


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="training steps (optimizer updates)")
    parser.add_argument("--devices", type=int, default=2, help="processes: CPU processes (gloo), or GPUs")
    parser.add_argument("--out", default="runs/fsdp", help="folder for the CSV logs and skips.json")
    parser.add_argument(
        "--fast", action="store_true", help="8 steps, the overflow at steps 3 and 4 (the test suite's smoke test)"
    )
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import AmpPlusFSDPPrecision, LossScaleMonitor, NaNSkipReporter


class CPUFSDPStrategy(FSDPStrategy):
    """FSDP on CPU for demos and tests; on GPUs use ``FSDPStrategy`` itself.

    Lightning accepts ``FSDPStrategy`` on CPU only through a subclass, and FSDP1 needs ``device_id=cpu`` there.
    Defaults: gloo, and sharded checkpoints (torch's full-state-dict path needs CUDA).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        kwargs.setdefault("state_dict_type", "sharded")
        super().__init__(**kwargs)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class Regressor(LightningModule):
    def __init__(self, poison: set[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 1))
        self.poison = poison

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        # fault injection: an inf in the last rank's own shard of one parameter (the others hold none of it)
        if self.global_rank == self.trainer.world_size - 1 and self.trainer.global_step in self.poison:
            grad = self.net[3].weight.grad
            if grad is not None and grad.numel():
                grad.view(-1)[0] = float("inf")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> AmpPlusFSDPPrecision:
    args = parser().parse_args(argv)
    seed_everything(0)
    x = torch.randn(4096, 32)
    loader = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=32)
    cuda = torch.cuda.is_available()
    strategy = FSDPStrategy(state_dict_type="sharded") if cuda else CPUFSDPStrategy()
    plugin = AmpPlusFSDPPrecision("16-mixed", init_scale=2.0**12, growth_interval=10)
    steps = 8 if args.fast else args.steps
    trainer = Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=strategy,
        plugins=[plugin],
        max_steps=steps,
        gradient_clip_val=1.0,  # the global norm over every rank's shards, after the unscale
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=5,
        callbacks=[LossScaleMonitor(), NaNSkipReporter(report_path=f"{args.out}/skips.json")],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(poison={3, 4} if args.fast else {20, 21, 40}), loader)
    if trainer.is_global_zero:
        print(
            f"rank 0 of {trainer.world_size}: updates {plugin.history.num_steps}, applied {plugin.applied_steps},"
            f" skipped at step {plugin.history.skipped_steps}; scale curve {plugin.history.curve()}"
        )
    return plugin


if __name__ == "__main__":
    main()
