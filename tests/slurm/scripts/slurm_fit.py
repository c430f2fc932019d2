"""A ddp fit started by ``srun``: each rank writes what SLURM told it and its final weights.

Usage: slurm_fit.py OUT_DIR DEVICES [NUM_NODES]
Each rank writes ``OUT_DIR/rank<global rank>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "strategies"))

from models import LinearModel, flat_weights, loader

import accord


def main() -> None:
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    num_nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    model = LinearModel()
    trainer = accord.Trainer(
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
