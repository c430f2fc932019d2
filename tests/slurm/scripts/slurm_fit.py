"""A ddp fit started by ``srun``: each rank writes what SLURM told it and its final weights.

Usage: slurm_fit.py OUT_DIR DEVICES [NUM_NODES]
Each rank writes ``OUT_DIR/rank<global rank>.pt``.

With ``MEET_DIR`` and ``MEET_COUNT`` set, every rank, once its process group is up, writes
a file into MEET_DIR and trains only when MEET_COUNT such files exist: jobs or steps that
share MEET_DIR then hold their process groups (and ports) at the same time.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Run by path (by a test, torchrun, horovodrun or srun): the repository root goes on the
# path, so the test helpers import as the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import accord
from accord.callbacks import Callback
from tests.helpers.models import LinearModel, flat_weights, loader


class Meet(Callback):
    """Waits at the start of training until every rank of every meeting job is there."""

    def __init__(self, directory: Path, count: int) -> None:
        self.directory = directory
        self.count = count

    def on_train_start(self, trainer: accord.Trainer, module: Any) -> None:
        job = os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"], trainer.global_rank
        (self.directory / "{}.{}.{}".format(*job)).touch()
        deadline = time.monotonic() + 180
        while len(list(self.directory.iterdir())) < self.count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {list(self.directory.iterdir())} met in 180 s")
            time.sleep(0.1)


def main() -> None:
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    num_nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    model = LinearModel()
    meet = os.environ.get("MEET_DIR")
    trainer = accord.Trainer(
        callbacks=[Meet(Path(meet), int(os.environ["MEET_COUNT"]))] if meet else None,
        strategy="ddp",
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    strategy = trainer.strategy
    environment = strategy.cluster_environment
    assert environment is not None
    trainer.fit(model, loader(batch_size=16))
    torch.save(
        {
            "environment": type(environment).__name__,
            "global_rank": trainer.global_rank,
            "local_rank": strategy.local_rank,
            "node_rank": strategy.node_rank,
            "world_size": trainer.world_size,
            "main_address": environment.main_address,
            "main_port": environment.main_port,
            "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
            "weights": flat_weights(model),
            "global_step": trainer.global_step,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
