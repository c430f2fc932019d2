"""Fits that save or resume a mid-epoch checkpoint, for ``test_horovod.py``'s moves between
``horovod`` and ``single_device``.

Usage: python horovod_resume.py OUT_DIR TAG STRATEGY SAVE|full|CKPT_PATH
(under ``horovodrun --gloo -np 2 -H localhost:2`` for ``STRATEGY=horovod``).

The fit is tests/reliability/test_resume_matrix.py's: 96 samples in a global batch of 24
(24 per batch on one device, 12 per rank on two), Adam with an LR halved every epoch,
3 epochs. ``SAVE`` stops at step 6, half-way through epoch 1, where a
``ModelCheckpoint(every_n_train_steps=6)`` has written ``OUT_DIR/TAG/saved.ckpt``;
``full`` runs the 3 epochs uninterrupted; a path resumes from that checkpoint to the end.
Each rank writes ``OUT_DIR/TAG-rank<rank>.pt``: the final weights and the
(epoch, sample) pairs it trained on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import ModelCheckpoint

SAMPLES, GLOBAL_BATCH, EPOCHS, SAVE_STEP = 96, 24, 3, 6
RANK = int(os.environ.get("HOROVOD_RANK", 0))


class Recorder(accord.Module):
    """Two linear layers trained with Adam (LR halved every epoch); records each sample's
    index with the epoch it was trained in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 1))
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out.squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        epoch = self.trainer.current_epoch
        self.seen.extend((epoch, int(i)) for i in index.tolist())
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = x.sum(dim=1) + 0.1 * torch.randn(SAMPLES, generator=generator)
    return TensorDataset(x, y, torch.arange(SAMPLES))


def fit(out: Path, tag: str, strategy: str, mode: str) -> dict[str, Any]:
    devices = 2 if strategy == "horovod" else 1
    save = mode == "SAVE"
    callbacks = (
        [ModelCheckpoint(dirpath=out / tag, filename="saved", every_n_train_steps=SAVE_STEP)]
        if save
        else []
    )
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=save,
        callbacks=callbacks,
        max_epochs=EPOCHS,
        max_steps=SAVE_STEP if save else -1,
    )
    model = Recorder()
    loader = DataLoader(data(), batch_size=GLOBAL_BATCH // devices)
    ckpt_path = None if mode in ("SAVE", "full") else mode
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    weights = {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()}
    return {"weights": weights, "seen": model.seen, "global_step": trainer.global_step}


def main() -> None:
    out, tag, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(fit(out, tag, strategy, mode), out / f"{tag}-rank{RANK}.pt")


if __name__ == "__main__":
    main()
