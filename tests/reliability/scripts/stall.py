"""A two-rank ddp fit in which rank 1 stops taking part at its third training batch.

Usage: stall.py MODE [STRATEGY]

``MODE`` is how rank 1 stops: ``freeze`` (it sends itself SIGSTOP), ``kill`` (SIGKILL, in
the middle of the backward pass, while rank 0 waits in DDP's gradient reduction) or
``skip`` (it skips a barrier rank 0 makes and goes on to the next backward). ``STRATEGY``
is ``ddp`` (the default), ``ddp_spawn`` or ``ddp_fork``; under torchrun, ``ddp``. Run it with
``ACCORD_COLLECTIVE_TIMEOUT`` set; every rank prints its error's class and ``ranks`` or
``missing_ranks`` as ``RESULT <rank> <class> <ranks> <time>`` (and rank 1 ``STALL <time>`` as it stops) and exits with status 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import Callback

STALL_AT = 2


class Model(accord.Module):
    """A linear layer trained with SGD; rank 1 stops at batch `STALL_AT` as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.mode = mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x).squeeze(-1)
        if self.global_rank == 1 and batch_idx == STALL_AT and self.mode != "skip":
            out.register_hook(self._stop)
        return nn.functional.mse_loss(out, y)

    def _stop(self, grad: torch.Tensor) -> torch.Tensor:
        # Inside backward: rank 0 is (or soon is) in DDP's gradient all-reduce.
        print(f"STALL {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if self.mode == "freeze" else signal.SIGKILL)
        return grad

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SkipsOnRankOne(Callback):
    """The bug of ``skip``: a barrier inside ``if rank != 1``."""

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == STALL_AT and trainer.global_rank == 1:
            print(f"STALL {time.time()}", flush=True)
        if batch_idx == STALL_AT and trainer.global_rank != 1:
            trainer.strategy.barrier("sync")


def main(mode: str, strategy: str) -> None:
    """Fit until rank 1 stops; print the error every rank ends with."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(256, 4, generator=generator), torch.randn(256, generator=generator)
    )
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[SkipsOnRankOne()] if mode == "skip" else [],
    )
    try:
        trainer.fit(Model(mode), DataLoader(data, batch_size=8))
    except Exception as err:
        ranks = getattr(err, "ranks", getattr(err, "missing_ranks", None))
        print(
            f"RESULT {trainer.global_rank} {type(err).__name__} {ranks} {time.time()}", flush=True
        )
        print(f"MESSAGE {trainer.global_rank} {err}", flush=True)
        raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
