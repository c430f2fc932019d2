"""A training script for SLURM: one task per device, preemption-safe, resumes by itself.

Submit it with ``sbatch train.sbatch --root /shared/run1`` (see docs/multi-node.md). Every
task is one rank; accord reads its place in the job from SLURM's variables. On SIGUSR1
(``sbatch --signal=USR1@90``) or SIGTERM the ranks stop together after one checkpoint in
``ROOT/checkpoints``; the requeued job resumes from the newest checkpoint there, and rank
zero writes the final weights to ``ROOT/model.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import ModelCheckpoint


class Regressor(accord.Module):
    """A small MLP fitted to a fixed, generated regression task."""

    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(samples: int, features: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    y = torch.sin(x @ torch.randn(features, generator=generator))
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="checkpoints and results")
    parser.add_argument("--devices", type=int, default=1, help="tasks (devices) per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    trainer = accord.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        default_root_dir=args.root,
        callbacks=[ModelCheckpoint(every_n_train_steps=50)],
        preemption_signals=["SIGTERM", "SIGUSR1"],
        logger=False,
        enable_progress_bar=False,
    )
    model = Regressor()
    # No ckpt_path: a requeued job (SLURM_RESTART_COUNT > 0) resumes from the newest
    # checkpoint in ROOT/checkpoints by itself (Trainer(auto_resume=True), the default).
    trainer.fit(model, DataLoader(dataset(args.samples), batch_size=32))
    if trainer.is_global_zero:
        torch.save(model.state_dict(), args.root / "model.pt")
        print(f"trained {trainer.global_step} steps; weights in {args.root / 'model.pt'}")


if __name__ == "__main__":
    main()
