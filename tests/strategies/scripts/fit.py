"""A fit run as a script, for launchers that start processes themselves (popen, torchrun).

Usage: fit.py OUT_DIR STRATEGY DEVICES NUM_NODES [FAIL_RANK [raise|kill]]
Each rank writes ``OUT_DIR/rank<global rank>.pt`` with its final weights and metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# Run by path (by a test, torchrun, horovodrun or srun): the repository root goes on the
# path, so the test helpers import as the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import accord
from tests.helpers.models import FailingModel, LinearModel, flat_weights, loader


def main() -> None:
    out, strategy, devices, num_nodes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if len(sys.argv) > 5:
        how = sys.argv[6] if len(sys.argv) > 6 else "raise"
        model: LinearModel = FailingModel(int(sys.argv[5]), how)
    else:
        model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    train_loss = float(trainer.callback_metrics["train_loss_epoch"])
    # A second run in the same processes: the group is made again on the same port.
    (tested,) = trainer.test(model, loader(batch_size=16))
    torch.save(
        {
            "weights": flat_weights(model),
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "losses": model.losses,
            "train_loss": train_loss,
            "test_loss": tested["test_loss"],
        },
        Path(out) / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
