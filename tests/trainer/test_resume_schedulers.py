"""A resumed fit equals the uninterrupted one: weights and every learning rate, for epoch,
step (with ``frequency``) and monitored schedulers, from checkpoints taken after
validation at the end of an epoch, at the end of a training epoch, and mid-epoch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import accord
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader

EPOCHS = 4


class ScheduledModel(LinearModel):
    """SGD with three schedulers chained on it, recording the LR of every batch."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.lrs: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self) -> None:
        # While the group is up: FSDP's parameters are shards, gathered here on every rank.
        self.final = torch.cat(
            [
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                for p in self.parameters()
            ]
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        # Never improves, so the plateau scheduler (patience 0) acts every epoch.
        self.log("flat", 1.0)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        by_epoch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        by_step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.8)
        return [optimizer], [
            {"scheduler": by_epoch, "interval": "epoch"},
            {"scheduler": by_step, "interval": "step", "frequency": 3},
            {"scheduler": plateau, "interval": "epoch", "monitor": "flat"},
        ]


class SaveAt(accord.callbacks.Callback):
    """Save in epoch 1: after validation, at the training epoch's end, and mid-epoch."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.stage == "fit" and trainer.current_epoch == 1:
            trainer.save_checkpoint(self.root / "after_validation.ckpt")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == 1:
            trainer.save_checkpoint(self.root / "epoch_end.ckpt")

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 1 and batch_idx == 4:
            trainer.save_checkpoint(self.root / "mid_epoch.ckpt")


def _fit(strategy: str, devices: int, model: ScheduledModel, **kwargs: Any) -> accord.Trainer:
    trainer = accord.Trainer(
        strategy=strategy,
        devices=devices,
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **{k: v for k, v in kwargs.items() if k != "ckpt_path"},
    )
    batch = 32 // devices  # the same global batch at every world size
    trainer.fit(
        model,
        loader(batch, samples=224, shuffle=True),
        loader(batch, samples=64),
        ckpt_path=kwargs.get("ckpt_path"),
    )
    return trainer


def _resume_runs(strategy: str, devices: int, root: Path) -> dict[str, Any]:
    torch.manual_seed(3)
    straight = ScheduledModel()
    trainer = _fit(strategy, devices, straight, callbacks=[SaveAt(root)])
    results: dict[str, Any] = {
        "straight": (straight.final, straight.lrs),
        "lr_state": torch.load(root / "epoch_end.ckpt", weights_only=True)["lr_schedulers"][0]
        if (root / "epoch_end.ckpt").is_file()
        else None,
        "global_step": trainer.global_step,
    }
    for name in ("after_validation", "epoch_end", "mid_epoch"):
        torch.manual_seed(99)  # the checkpoint, not this seed, decides what comes next
        resumed = ScheduledModel()
        _fit(strategy, devices, resumed, ckpt_path=root / f"{name}.ckpt")
        results[name] = (resumed.final, resumed.lrs)
    return results


def _check(results: dict[str, Any]) -> None:
    weights, lrs = results["straight"]
    batches = 224 // 32
    for name in ("after_validation", "epoch_end", "mid_epoch"):
        resumed_weights, resumed_lrs = results[name]
        torch.testing.assert_close(resumed_weights, weights, rtol=0, atol=1e-6, msg=name)
        # The resumed run records the LRs of the batches it ran: the tail of the straight run.
        assert resumed_lrs == pytest.approx(lrs[-len(resumed_lrs) :], rel=1e-6, abs=0), name
        expected = (EPOCHS - 2) * batches if name != "mid_epoch" else (EPOCHS - 1) * batches - 5
        assert len(resumed_lrs) == expected, name


def _distributed(rank: int, world_size: int, strategy: str, root: str) -> dict[str, Any]:
    directory = Path(root)
    directory.mkdir(parents=True, exist_ok=True)
    return _resume_runs(strategy, world_size, directory)


def test_single_device_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    results = _resume_runs("single_device", 1, tmp_path)
    _check(results)
    # As in Lightning: a checkpoint taken at an epoch's end holds the epoch's scheduler step.
    assert results["lr_state"]["last_epoch"] == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2"])
def test_multi_rank_resume_equals_the_uninterrupted_run(strategy: str, tmp_path: Path) -> None:
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'accord[deepspeed]')")
    for results in run_distributed(_distributed, 2, strategy, str(tmp_path), timeout=500):
        _check(results)
