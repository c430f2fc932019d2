"""A four-rank fit that may lose ranks on the way (``on_rank_loss="continue"``).

Usage: rank_loss_fit.py OUT [KILL ...]

Each ``KILL`` is ``RANK:STEP:WHERE``: the process of that rank stops itself when it reaches
``WHERE`` at global step ``STEP`` (``forward``, in ``training_step``; ``backward``, in the
backward pass, while the others wait in DDP's gradient reduction; ``validation``, in
``validation_step``; ``save``, in ``on_save_checkpoint``; ``term``, as ``forward`` but with
SIGTERM, a preemption, whatever ``FIT_SIGNAL`` says). With no ``KILL`` the run is the
uninterrupted reference, under ``on_rank_loss="fail"``.

Environment: ``FIT_STRATEGY`` (``ddp``, the default, ``ddp_spawn`` or ``ddp_fork``),
``FIT_SIGNAL`` (``KILL``, the default, ``STOP`` to freeze the rank, or ``TERM`` for a
preemption), ``FIT_STEPS`` (200), ``FIT_RESTARTS`` (``DDPStrategy(max_restarts=...)``),
``FIT_SLOW`` (seconds each training step sleeps, so that a replacement has time to start),
``FIT_CKPT`` (a checkpoint to resume from), ``FIT_PROFILER`` (``Trainer(profiler=...)``). Under torchrun the strategy is ``ddp``.

The model is an MLP trained with Adam and a step LR scheduler on 800 shuffled samples in
batches of 8 per rank, validated every 10 steps and saved every 8. Every rank appends
``[epoch, step, sample indices]`` for each batch it trained on to ``OUT/seen.<pid>.jsonl``;
rank 0 saves the final weights to ``OUT/final.pt`` and prints ``DONE <world size> <step>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import Callback, ModelCheckpoint
from accord.strategies import DDPStrategy

OUT = Path(sys.argv[1])
KILLS = [(int(r), int(s), w) for r, s, w in (k.split(":") for k in sys.argv[2:])]
SIGNAL = getattr(signal, "SIG" + os.environ.get("FIT_SIGNAL", "KILL"))
STEPS = int(os.environ.get("FIT_STEPS", "200"))
SLOW = float(os.environ.get("FIT_SLOW", "0"))


def stop_here(where: str, step: int) -> None:
    """Send this process its signal if a ``KILL`` names this rank, ``where`` and ``step``."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    if (rank, step, where) in KILLS:
        print(f"STOPPING rank {rank} at {where} of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM if where == "term" else SIGNAL)


class Model(accord.Module):
    """Two linear layers; stops its rank where a ``KILL`` says."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        step = self.trainer.global_step
        stop_here("forward", step)
        stop_here("term", step)
        if SLOW:
            time.sleep(SLOW)
        out = self.net(x).squeeze(-1)
        out.register_hook(lambda grad: (stop_here("backward", step), grad)[1])
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        stop_here("validation", self.trainer.global_step)
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Record(Callback):
    """Writes the samples of every batch this rank trained on; stops a rank mid-save."""

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        with (OUT / f"seen.{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps([trainer.current_epoch, trainer.global_step, batch[2].tolist()]))
            f.write("\n")

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
        stop_here("save", trainer.global_step)


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    n = 800
    train = TensorDataset(
        torch.randn(n, 8, generator=generator), torch.randn(n, generator=generator), torch.arange(n)
    )
    val = TensorDataset(
        torch.randn(96, 8, generator=generator),
        torch.randn(96, generator=generator),
        torch.arange(96),
    )
    name = os.environ.get("FIT_STRATEGY", "ddp")
    restarts = int(os.environ.get("FIT_RESTARTS", "0"))
    start_method = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}[name]
    strategy = DDPStrategy(start_method=start_method, max_restarts=restarts)  # type: ignore[arg-type]
    trainer = accord.Trainer(
        strategy=strategy,
        devices=4,
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=10,
        num_sanity_val_steps=0,
        callbacks=[
            Record(),
            ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=8, save_top_k=-1),
        ],
        on_rank_loss="continue" if KILLS else "fail",
        profiler=os.environ.get("FIT_PROFILER"),
        default_root_dir=OUT,
    )
    model = Model()
    loader = DataLoader(train, batch_size=8, shuffle=True)
    trainer.fit(model, loader, DataLoader(val, batch_size=8), ckpt_path=os.environ.get("FIT_CKPT"))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), OUT / "final.pt")
        print(f"DONE {trainer.world_size} {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
