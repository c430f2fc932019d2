"""A user's training script whose checkpoints take a while to write.

Usage: big_fit.py ROOT STRATEGY [CKPT_PATH]

Two processes (``devices=2``), the default `ModelCheckpoint` (keep the newest, in
``ROOT/checkpoints``), four epochs of four optimizer steps. The model carries 32M frozen
parameters, so every checkpoint holds 128 MB. Each rank writes ``ROOT/rank<r>.json`` with
its pid and the step its fit started from, and ``ROOT/rank<r>.end.json`` when it ends.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord


class BigModel(accord.Module):
    """A linear head trained with SGD beside a large frozen table it reads."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.root = root
        self.head = nn.Linear(8, 1)
        self.table = nn.Parameter(torch.randn(32_000_000), requires_grad=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(x + self.table[:8]).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)

    def on_fit_start(self) -> None:
        self._record("", start_step=self.trainer.global_step)

    def on_fit_end(self) -> None:
        self._record(".end", end_step=self.trainer.global_step)

    def _record(self, suffix: str, **values: int) -> None:
        info = {"pid": os.getpid(), **values}
        (self.root / f"rank{self.trainer.global_rank}{suffix}.json").write_text(json.dumps(info))


def main() -> None:
    root, strategy = Path(sys.argv[1]), sys.argv[2]
    ckpt_path = sys.argv[3] if len(sys.argv) > 3 else None
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=4,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
    )
    data = DataLoader(TensorDataset(x, x.sum(-1)), batch_size=8)
    trainer.fit(BigModel(root), data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
