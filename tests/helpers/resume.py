"""The resume matrix's fit: a small model and an indexed dataset, saved mid-epoch.

A fit of 3 epochs of 4 global batches of 24 (Adam, an LR that halves every epoch) that
records which sample each rank trained on, in which epoch; the global batch is the same
on 1, 2 or 3 ranks (24 = 1 x 24 = 2 x 12 = 3 x 8). Used by the resume matrix and by the
checkpoint command's tests, which inspect and convert the checkpoints it saves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.callbacks import Callback
from accord.strategies import FSDPStrategy

__all__ = [
    "EPOCHS",
    "GLOBAL_BATCH",
    "MidEpochSaves",
    "SAMPLES",
    "SAVE_STEP",
    "Recorder",
    "SaveAt",
    "UNINTERRUPTED",
    "indexed_data",
    "fit",
    "save_mid_epoch",
    "saved_path",
    "strategy_named",
]

SAMPLES, GLOBAL_BATCH, EPOCHS, SAVE_STEP = 96, 24, 3, 6
"""Samples in the dataset, the global batch, the epochs of a whole fit, and the step a
checkpoint is saved at (half-way through epoch 1)."""

MidEpochSaves = tuple[Path, dict[str, list[tuple[int, int]]]]
"""Where `save_mid_epoch`'s checkpoints are, and the (epoch, sample) pairs of each run."""

UNINTERRUPTED = "uninterrupted.ckpt"
"""Where `save_mid_epoch` puts the checkpoint of the whole ddp fit, in its root."""


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


class SaveAt(Callback):
    """Saves the training state to ``path`` once ``global_step`` reaches ``step`` (with
    ``step=None``, when the fit ends)."""

    def __init__(self, path: Path, step: int | None) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: accord.Trainer, module: accord.Module, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.step is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_fit_end(self, trainer: accord.Trainer, module: accord.Module) -> None:
        if self.step is None:
            trainer.save_checkpoint(self.path)


def indexed_data(samples: int = SAMPLES) -> TensorDataset:
    """``samples`` regression samples, each with its index as a third tensor."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=generator)
    y = x.sum(dim=1) + 0.1 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y, torch.arange(samples))


def strategy_named(name: str) -> accord.strategies.Strategy | str:
    """The strategy ``name``; FSDP wraps each linear layer and saves sharded."""
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    return name


def fit(
    name: str,
    devices: int,
    save: Path,
    *,
    save_step: int | None = None,
    ckpt_path: Path | None = None,
    shuffle: bool = False,
) -> list[tuple[int, int]]:
    """Fit under strategy ``name`` on ``devices`` ranks with the global batch of 24; save at
    ``save_step`` (and stop there) or at the end. Returns the (epoch, sample) pairs this
    rank trained on."""
    trainer = accord.Trainer(
        strategy=strategy_named(name),
        devices=devices,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[SaveAt(save, save_step)],
        max_epochs=EPOCHS,
        max_steps=save_step if save_step is not None else -1,
    )
    model = Recorder()
    loader = DataLoader(indexed_data(), batch_size=GLOBAL_BATCH // devices, shuffle=shuffle)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model.seen


def saved_path(root: Path, name: str) -> Path:
    """Where the checkpoint saved mid-epoch under strategy ``name`` goes in ``root``."""
    return root / f"saved-{name}.ckpt"


def save_mid_epoch(
    rank: int, world_size: int, root: Path, names: tuple[str, ...]
) -> dict[str, list[tuple[int, int]]]:
    """On 2 ranks: the whole ddp fit (saved as `UNINTERRUPTED`), then a fit under each
    strategy of ``names`` saved at `SAVE_STEP` (to `saved_path`). Returns the (epoch,
    sample) pairs this rank trained on in each, by strategy (``"uninterrupted"``)."""
    seen = {"uninterrupted": fit("ddp", world_size, root / UNINTERRUPTED)}
    for name in names:
        seen[name] = fit(name, world_size, saved_path(root, name), save_step=SAVE_STEP)
    return seen
