"""self.log: defaults as in Lightning, exact epoch means, and one collective per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.errors import ConfigurationError
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import CountingCollective, LinearModel, loader


class TenMetrics(LinearModel):
    """Logs ten synced metrics every step, and the rank as an epoch mean."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"m{i}": float(i + self.global_rank) for i in range(10)}, sync_dist=True)
        self.log("rank_max", float(self.global_rank), sync_dist=True, reduce_fx="max")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # Rank r weighs its values by r + 1: the synced epoch mean must be weighted too.
        self.log(
            "rank_mean", float(self.global_rank), sync_dist=True, batch_size=self.global_rank + 1
        )


def _fit_counting(rank: int, world_size: int) -> dict[str, Any]:
    collective = CountingCollective()
    model = TenMetrics()
    trainer = accord.Trainer(
        strategy=DDPStrategy(collective=collective),
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    val = DataLoader(TensorDataset(torch.randn(3, 8), torch.randn(3)), batch_size=1)
    trainer.fit(model, loader(16), val)
    return {
        "calls": collective.calls,
        "steps": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def test_all_metrics_of_a_step_travel_in_one_collective() -> None:
    results = run_distributed(_fit_counting, 2, timeout=120)
    for result in results:
        steps = result["steps"]
        # One all_gather per training step (12 metrics), plus one per epoch end
        # (train and validation), and nothing else: no barrier, no per-metric calls. The
        # ranks' decision whether the step counts rides in DDP's gradient reduction.
        assert result["calls"] == {"all_gather": steps + 2}
        metrics = result["metrics"]
        assert metrics["m0"] == 0.5 and metrics["m9"] == 9.5
        assert metrics["rank_max"] == 1.0
        # (0 * 1 + 1 * 2) / (1 + 2) per batch, over two batches on each rank.
        assert metrics["rank_mean"] == pytest.approx(2 / 3)
    assert results[0]["metrics"] == results[1]["metrics"]


def test_log_defaults_follow_lightning(tmp_path: Path) -> None:
    model = LinearModel()
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader(16), loader(64))
    # training_step: on_step by default (the model asks on_epoch too, so both get suffixes);
    # validation_step: on_epoch only, no suffix.
    assert {"train_loss_step", "train_loss_epoch", "val_loss"} <= set(trainer.callback_metrics)
    assert "train_loss_epoch" in trainer.progress_bar_metrics


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (torch.ones(2), {}, "one number"),
        ("high", {}, "log a number"),
        (1.0, {"reduce_fx": "median"}, "reduce_fx"),
    ],
)
def test_bad_log_calls(tmp_path: Path, value: Any, kwargs: dict[str, Any], message: str) -> None:
    class Bad(LinearModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("bad", value, **kwargs)
            return super().training_step(batch, batch_idx)

    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ConfigurationError, match=message):
        trainer.fit(Bad(), loader(16))


def test_log_outside_a_run() -> None:
    with pytest.raises(ConfigurationError, match="outside a Trainer run"):
        LinearModel().log("x", 1.0)


def test_lightning_style_optimizer_config(tmp_path: Path) -> None:
    class WithScheduler(LinearModel):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
            }

    model = WithScheduler()
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader(16))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


class StepAndEpoch(LinearModel):
    """Logs ``train_loss`` per step and per epoch, as Lightning users often do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, on_step=True, on_epoch=True)


def test_a_metric_logged_per_step_and_per_epoch_keeps_its_bare_name(tmp_path: Path) -> None:
    checkpoint = accord.callbacks.ModelCheckpoint(monitor="train_loss", save_top_k=1)
    stopping = accord.callbacks.EarlyStopping(monitor="train_loss", patience=1)
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=3,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        callbacks=[checkpoint, stopping],
        log_every_n_steps=1,
    )
    trainer.fit(StepAndEpoch(), loader(32), loader(32, samples=64))
    metrics = trainer.callback_metrics
    # The bare name holds the epoch aggregate once the epoch has ended, as in Lightning.
    assert {"train_loss", "train_loss_step", "train_loss_epoch"} <= set(metrics)
    assert float(metrics["train_loss"]) == float(metrics["train_loss_epoch"])
    # A validation step's value is not a callback metric; its epoch value is, under both names.
    assert "val_loss_step" not in metrics
    assert float(metrics["val_loss"]) == float(metrics["val_loss_epoch"])
    assert checkpoint.best_model_score is not None
    # The loggers and the progress bar see the suffixed names only.
    assert {"train_loss_step", "train_loss_epoch", "val_loss_epoch"} <= set(trainer.logged_metrics)
    assert "train_loss" not in trainer.logged_metrics
    assert trainer.logged_metrics["train_loss_epoch"] == float(metrics["train_loss_epoch"])
    assert set(trainer.progress_bar_metrics) == {"train_loss_step", "train_loss_epoch"}


def test_logged_metrics_follow_log_every_n_steps(tmp_path: Path) -> None:
    model = StepAndEpoch()
    trainer = accord.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=2,
    )
    trainer.fit(model, loader(32))
    # Steps 1 and 3 are not multiples of 2; step 2's value is the last one logged.
    assert trainer.logged_metrics["train_loss_step"] != float(
        trainer.callback_metrics["train_loss_step"]
    )
