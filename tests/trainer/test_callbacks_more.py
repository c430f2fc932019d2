"""LearningRateMonitor, ModelSummary, GradientAccumulationScheduler, Timer, and callback
state in checkpoints."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accord
from accord.callbacks import (
    Callback,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelSummary,
    Timer,
    summarize,
)
from accord.errors import ConfigurationError
from accord.loggers import CSVLogger
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader


def _trainer(root: Path, callbacks: list[Callback], **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 2,
        "limit_train_batches": 4,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "default_root_dir": root,
        "logger": False,
        **kwargs,
    }
    return accord.Trainer(callbacks=callbacks, **settings)


class Scheduled(LinearModel):
    """SGD with two parameter groups and a StepLR that halves the LR every step."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            [{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": 0.01}],
            lr=0.1,
            momentum=0.9,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_lr_monitor_logs_the_lr_each_step_uses(tmp_path: Path) -> None:
    monitor = LearningRateMonitor(log_momentum=True)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, [monitor], logger=logger, log_every_n_steps=1)
    trainer.fit(Scheduled(), loader(16))
    # 8 optimizer steps; step k ran with 0.1 * 0.5**k (and the second group 0.01 * ...).
    assert monitor.lrs["lr-SGD/pg1"] == pytest.approx([0.1 * 0.5**k for k in range(8)])
    assert monitor.lrs["lr-SGD/pg2"] == pytest.approx([0.01 * 0.5**k for k in range(8)])
    assert monitor.last_momentum_values == {"lr-SGD/pg1-momentum": 0.9, "lr-SGD/pg2-momentum": 0.9}
    assert "lr-SGD/pg1-momentum" not in monitor.lrs
    rows = [r for r in _rows(logger.metrics_file) if r.get("lr-SGD/pg1")]
    assert [int(r["step"]) for r in rows] == list(range(8))
    assert [float(r["lr-SGD/pg1"]) for r in rows] == pytest.approx(monitor.lrs["lr-SGD/pg1"])


def test_lr_monitor_epoch_interval_and_names() -> None:
    class Two(LinearModel):
        def configure_optimizers(self) -> Any:
            return [
                torch.optim.Adam([self.layer.weight], lr=0.1),
                torch.optim.Adam([self.layer.bias], lr=0.2),
            ]

    model = Two()
    monitor = LearningRateMonitor(logging_interval="epoch", log_momentum=True)
    trainer = _trainer(Path(), [monitor])
    trainer._state.optimizers = list(model.configure_optimizers())
    assert monitor.stats(trainer, "epoch") == {
        "lr-Adam": 0.1,
        "lr-Adam-momentum": 0.9,
        "lr-Adam-1": 0.2,
        "lr-Adam-1-momentum": 0.9,
    }
    with pytest.raises(ConfigurationError, match="logging_interval='batch'"):
        LearningRateMonitor(logging_interval="batch")


def test_lr_monitor_without_a_logger_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="LearningRateMonitor needs a logger"):
        _trainer(tmp_path, [LearningRateMonitor()]).fit(LinearModel(), loader(16))


class Frozen(LinearModel):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(1))


def test_model_summary_counts_per_child(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = {r.name: r for r in summarize(Frozen())}
    assert list(rows) == ["layer", "encoder", "other params"]
    assert (rows["layer"].trainable, rows["layer"].frozen) == (9, 0)
    assert (rows["encoder"].trainable, rows["encoder"].frozen) == (0, 72)
    assert rows["encoder"].type == "Sequential"
    assert rows["other params"].size_bytes == 4
    summary = ModelSummary()
    with caplog.at_level(logging.INFO, logger="accord"):
        _trainer(tmp_path, [summary], max_epochs=1).fit(Frozen(), loader(16))
    out = caplog.text
    assert summary.text in out
    assert "10         Trainable params" in out
    assert "72         Non-trainable params" in out
    assert "82         Total params" in out
    assert re.search(r"encoder\s+\| Sequential\s+\| 72\s+\| 0\s+\| 72\s", out)


def test_gradient_accumulation_scheduler_changes_the_steps(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [GradientAccumulationScheduler({1: 2, 2: 4})], max_epochs=3)
    trainer.fit(LinearModel(), loader(16))
    # 4 batches per epoch: 4 steps, then 2, then 1.
    assert trainer.global_step == 7
    with pytest.raises(ConfigurationError, match="both set the accumulation"):
        _trainer(
            tmp_path, [GradientAccumulationScheduler({0: 2, 1: 4})], accumulate_grad_batches=3
        ).fit(LinearModel(), loader(16))
    with pytest.raises(ConfigurationError, match="factor 0 at epoch 1"):
        GradientAccumulationScheduler({1: 0})


def test_timer_stops_when_the_budget_is_spent(tmp_path: Path) -> None:
    timer = Timer(duration="00:01:00:00")
    # A resumed run that already spent the hour stops after its first batch.
    timer.load_state_dict({"time_elapsed": 3600.0})
    trainer = _trainer(tmp_path, [timer], max_epochs=5)
    trainer.fit(LinearModel(), loader(16))
    assert trainer.global_step == 1
    assert timer.time_elapsed() >= 3600.0
    assert timer.state_dict()["time_elapsed"] >= 3600.0
    with pytest.raises(ConfigurationError, match="'DD:HH:MM:SS'"):
        Timer(duration="1 hour")
    untimed = Timer()
    _trainer(tmp_path, [untimed], max_epochs=1).fit(LinearModel(), loader(16))
    assert untimed.time_remaining() is None
    assert untimed.time_elapsed() > 0


def _timer_on_two_ranks(rank: int, world_size: int) -> int:
    timer = Timer(duration={"hours": 1})
    if rank == 1:
        timer.load_state_dict({"time_elapsed": 3600.0})
    trainer = accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[timer],
    )
    trainer.fit(LinearModel(), loader(16))
    return trainer.global_step


def test_timer_ranks_stop_together() -> None:
    # Only rank 1 is over budget; both stop after the same batch.
    assert run_distributed(_timer_on_two_ranks, 2, timeout=240) == [1, 1]


class Counting(Callback):
    """Counts the batches it saw; the count travels in checkpoints."""

    def __init__(self) -> None:
        self.batches = 0
        self.loaded: dict[str, Any] | None = None

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        self.batches = int(state["batches"])


def test_callback_state_round_trip(tmp_path: Path) -> None:
    first, timer = Counting(), Timer()
    trainer = _trainer(tmp_path, [first, timer], enable_checkpointing=True)
    trainer.fit(LinearModel(), loader(16))
    assert trainer.checkpoint_callback is not None
    path = trainer.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=True)["callbacks"]
    assert saved["Counting"] == {"batches": 8}
    assert saved["Timer"]["time_elapsed"] > 0

    second, resumed_timer = Counting(), Timer()
    resumed = _trainer(tmp_path, [second, resumed_timer], max_epochs=3)
    resumed.fit(LinearModel(), loader(16), ckpt_path=path)
    assert second.loaded == {"batches": 8}
    assert second.batches == 12
    assert resumed_timer.time_elapsed() >= saved["Timer"]["time_elapsed"]


class _HookOrder(Callback):
    """Records the fit's outer hooks, the callback's and the module's, in call order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_fit_start(self, trainer: accord.Trainer, module: Any) -> None:
        self.calls.append("callback.on_fit_start")

    def on_train_start(self, trainer: accord.Trainer, module: Any) -> None:
        self.calls.append(f"callback.on_train_start@{trainer.global_step}")

    def on_train_epoch_start(self, trainer: accord.Trainer, module: Any) -> None:
        self.calls.append("callback.on_train_epoch_start")

    def on_train_end(self, trainer: accord.Trainer, module: Any) -> None:
        self.calls.append(f"callback.on_train_end@{trainer.global_step}")

    def on_fit_end(self, trainer: accord.Trainer, module: Any) -> None:
        self.calls.append("callback.on_fit_end")


class _OrderModel(LinearModel):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def on_train_start(self) -> None:
        self.calls.append("module.on_train_start")

    def on_train_end(self) -> None:
        self.calls.append("module.on_train_end")


def test_train_start_and_end_reach_callbacks_before_the_module(tmp_path: Path) -> None:
    calls: list[str] = []
    trainer = _trainer(tmp_path, [_HookOrder(calls)], max_epochs=1)
    trainer.fit(_OrderModel(calls), loader(batch_size=16))
    assert calls == [
        "callback.on_fit_start",
        "callback.on_train_start@0",
        "module.on_train_start",
        "callback.on_train_epoch_start",
        "callback.on_train_end@4",
        "module.on_train_end",
        "callback.on_fit_end",
    ]


def test_batch_hooks_assigned_to_instances_run_on_every_batch(tmp_path: Path) -> None:
    """The loop resolves once which batch hooks are defined; one set on the object itself
    (not its class) counts, for a module and for a callback."""
    calls: list[str] = []
    model = LinearModel()
    model.on_train_batch_start = lambda batch, idx: calls.append(f"start {idx}")  # type: ignore[method-assign]
    model.on_after_backward = lambda: calls.append("after_backward")  # type: ignore[method-assign]
    callback = Callback()
    callback.on_train_batch_end = (  # type: ignore[method-assign]
        lambda trainer, module, outputs, batch, idx: calls.append(f"end {idx}")
    )
    _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=2).fit(model, loader(16))
    assert calls == ["start 0", "after_backward", "end 0", "start 1", "after_backward", "end 1"]


def test_progress_bar_shows_every_batch_and_the_prog_bar_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar ends each epoch at its batch count, with the last ``prog_bar=True`` values
    (metrics are formatted only for the updates the bar draws)."""
    trainer = _trainer(tmp_path, [], max_epochs=2, limit_train_batches=5, enable_progress_bar=True)
    model = LinearModel()
    trainer.fit(model, loader(16))
    err = capsys.readouterr().err
    for epoch in (0, 1):
        assert re.search(rf"Epoch {epoch}: 100%.*5/5 .*train_loss_step=", err), err
    # The last batch's loss, as the bar drew it at the end of the last epoch.
    assert err.rstrip().endswith(
        f"train_loss_step={model.losses[-1]:.4g}, train_loss_epoch="
        f"{trainer.progress_bar_metrics['train_loss_epoch']:.4g}]"
    ), err
