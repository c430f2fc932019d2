"""A user's training script with a bug: rank 1 skips a barrier the other ranks wait in.

Usage: skip_barrier.py ROOT [slow-exit]

Two processes (``devices=2``, the script is re-run for rank 1), one epoch. After the
second batch every rank but rank 1 waits in ``barrier("sync")``; then every rank reduces a
value. Run it with ``ACCORD_COLLECTIVE_TIMEOUT`` set: the watchdog stops the run, and each
rank leaves its last collective calls in ``ROOT/accord_traces`` (or ``ACCORD_TRACE_DIR``).
With ``slow-exit``, rank 1's ``on_exception`` hook takes two seconds and then says so.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import Callback


class Model(accord.Module):
    """A linear layer trained with SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SkipsOnRankOne(Callback):
    """The bug: a barrier inside ``if rank != 1``."""

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 1:
            if trainer.global_rank != 1:
                trainer.strategy.barrier("sync")
            trainer.strategy.reduce(torch.tensor(1.0))


class SlowExitOnRankOne(Callback):
    """Rank 1 takes its time to handle the failure, as a busy machine makes it."""

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if trainer.global_rank == 1:
            time.sleep(2)
            print(f"rank 1 handled {type(exception).__name__}", flush=True)


def main(root: str, slow_exit: bool = False) -> None:
    """Fit on two CPU processes until the watchdog stops the run."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, generator=generator)
    )
    trainer = accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[SkipsOnRankOne(), *([SlowExitOnRankOne()] if slow_exit else [])],
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main(sys.argv[1], slow_exit=sys.argv[2:] == ["slow-exit"])
