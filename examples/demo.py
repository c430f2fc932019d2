"""A real DDP fit on CPU: 2 processes, gloo, a small MLP on a generated regression task.

Run it with ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import accord


class Regressor(accord.Module):
    """y = sin(x·w) + noise, fitted by a two-layer MLP."""

    def __init__(self, features: int = 16, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log(
            "val_loss",
            nn.functional.mse_loss(self(x), y),
            prog_bar=True,
            sync_dist=True,
            batch_size=len(y),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_data(samples: int, features: int = 16, seed: int = 0) -> TensorDataset:
    """A fixed regression dataset (the same on every rank, for a given seed)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    w = torch.randn(features, generator=generator) / features**0.5
    y = torch.sin(x @ w * 2) + 0.05 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    accord.seed_everything(0)
    model = Regressor()
    data = make_data(5120)
    train = DataLoader(Subset(data, range(4096)), batch_size=64, shuffle=True)
    val = DataLoader(Subset(data, range(4096, 5120)), batch_size=256)
    with tempfile.TemporaryDirectory() as root:
        trainer = accord.Trainer(
            strategy=args.strategy,
            accelerator="cpu",
            devices=args.devices,
            max_epochs=args.epochs,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, train, val)
        if trainer.is_global_zero:
            print(
                f"\nstrategy={args.strategy} devices={args.devices} world_size="
                f"{trainer.world_size} epochs={trainer.current_epoch} steps={trainer.global_step}"
            )
            print(f"{'metric':<16}{'value':>12}")
            for name, value in sorted(trainer.callback_metrics.items()):
                print(f"{name:<16}{float(value):>12.5f}")


if __name__ == "__main__":
    main()
