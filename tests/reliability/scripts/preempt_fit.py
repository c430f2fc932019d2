"""A user's training script that is preempted, restarted or fed a NaN on purpose.

Usage: preempt_fit.py ROOT STRATEGY ACTION [ARGS...]

Two processes (``devices=2``, unless torchrun started them), three epochs of eight optimizer
steps each on deterministic data, checkpoints in ``ROOT/checkpoints``. ACTION is one of

- ``full``: train uninterrupted.
- ``signal WHO STEP``: once ``global_step`` reaches STEP, rank 1 sends SIGTERM to itself
  (``WHO=rank1``) or to the launching process (``WHO=launcher``), writing
  ``ROOT/signal.json`` (when and at which step) first.
- ``resume``: fit with ``ckpt_path="last"``.
- ``nan RANK STEP MODE``: the loss of global rank RANK is NaN at step STEP;
  ``Trainer(on_nonfinite=MODE)``.
- ``kill RANK STEP``: under torchrun's first attempt, global rank RANK kills itself with
  SIGKILL at step STEP; checkpoints every 5 steps, and a restart resumes by itself.

Every rank writes ``ROOT/final.rank<r>.pt`` (its whole weights) at the end of its fit, and
``ROOT/stop.rank<r>.json`` (the exception, its step and the time) when the fit raises.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Run by path (by a test, torchrun, horovodrun or srun): the repository root goes on the
# path, so the test helpers import as the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from torch.distributed.tensor import DTensor

import accord
from accord.callbacks import Callback, ModelCheckpoint
from accord.errors import NonFiniteValueError
from tests.helpers.models import LinearModel, loader


class Trigger(Callback):
    """Acts once, at the end of the batch after which ``global_step`` is ``step``."""

    def __init__(self, root: Path, action: str, args: list[str]) -> None:
        self.root = root
        self.action = action
        self.args = args

    def on_train_batch_end(
        self, trainer: accord.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.action == "signal":
            who, step = self.args[0], int(self.args[1])
            if trainer.global_rank == 1 and trainer.global_step == step:
                (self.root / "signal.json").write_text(
                    json.dumps({"time": time.time(), "step": step})
                )
                target = os.getpid() if who == "rank1" else _launcher_pid()
                os.kill(target, signal.SIGTERM)
        elif self.action == "kill":
            rank, step = int(self.args[0]), int(self.args[1])
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if first_attempt and trainer.global_rank == rank and trainer.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer: accord.Trainer, module: Any) -> None:
        # Inside the fit, while the group still exists: FSDP's sharded weights are
        # gathered here (a collective every rank makes).
        weights = torch.cat([_full(p).flatten() for p in module.parameters()])
        torch.save(
            {"weights": weights, "global_step": trainer.global_step},
            self.root / f"final.rank{trainer.global_rank}.pt",
        )

    def on_exception(self, trainer: accord.Trainer, module: Any, error: BaseException) -> None:
        record: dict[str, Any] = {
            "type": type(error).__name__,
            "step": trainer.global_step,
            "time": time.time(),
            "message": str(error),
        }
        if isinstance(error, NonFiniteValueError):
            record.update(ranks=error.ranks, error_step=error.step, metric=error.metric)
        (self.root / f"stop.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _full(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a DTensor (FSDP) is gathered from every rank."""
    value = parameter.detach()
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone()


def _launcher_pid() -> int:
    """The process that started the ranks: rank 0 under ``ddp`` (popen), else the parent."""
    return int(os.environ.get("ACCORD_PARENT_PID", os.getppid()))


class NaNModel(LinearModel):
    """`LinearModel` whose loss on ``rank`` is NaN at step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        super().__init__()
        self.nan_rank = rank
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        trainer = self.trainer
        if trainer.global_rank == self.nan_rank and trainer.global_step == self.nan_step:
            return loss * math.nan
        return loss


def main() -> None:
    root, strategy, action, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    model: LinearModel = LinearModel()
    on_nonfinite = "raise"
    if action == "nan":
        model = NaNModel(int(args[0]), int(args[1]))
        on_nonfinite = args[2]
    every = 5 if action == "kill" else None
    callbacks = [
        Trigger(root, action, args),
        ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=every),
    ]
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]) if torchrun else 2,
        max_epochs=3,
        default_root_dir=root,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        on_nonfinite=on_nonfinite,
    )
    ckpt_path = "last" if action == "resume" else None
    trainer.fit(model, loader(batch_size=16), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
