"""Single-device regression tests: a real fit, evaluation, checkpoints and resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import ModelCheckpoint
from accord.collectives import SingleDeviceCollective
from accord.strategies import SingleDeviceStrategy
from tests.helpers.models import LinearModel, flat_weights, loader


def _trainer(tmp_path: Path, **kwargs: Any) -> accord.Trainer:
    defaults: dict[str, Any] = {
        "strategy": "single_device",
        "accelerator": "cpu",
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    return accord.Trainer(**{**defaults, **kwargs})


def test_fit_reduces_the_loss_and_evaluates(tmp_path: Path) -> None:
    model = LinearModel()
    trainer = _trainer(tmp_path, max_epochs=3)
    trainer.fit(model, loader(16), loader(64))
    assert trainer.global_step == 3 * 16
    assert model.losses[-1] < model.losses[0] / 10
    assert set(trainer.callback_metrics) >= {"train_loss_step", "train_loss_epoch", "val_loss"}
    (validated,) = trainer.validate(model, loader(64))
    (tested,) = trainer.test(model, loader(64))
    assert validated["val_loss"] == pytest.approx(tested["test_loss"])
    predictions = trainer.predict(model, loader(64))
    assert [p.shape for p in predictions] == [torch.Size([64])] * 4


def test_the_strategy_owns_a_single_device_collective(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert isinstance(trainer.strategy.collective, SingleDeviceCollective)
    trainer.strategy.setup_environment()
    assert trainer.strategy.reduce_boolean_decision(True) is True
    assert trainer.strategy.reduce_boolean_decision(False, all=False) is False
    assert trainer.strategy.all_gather(torch.arange(3)).tolist() == [0, 1, 2]
    trainer.strategy.teardown()


def test_accumulation_and_limits(tmp_path: Path) -> None:
    model = LinearModel()
    trainer = _trainer(
        tmp_path,
        max_epochs=1,
        accumulate_grad_batches=4,
        limit_train_batches=10,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, loader(16))
    # 10 batches, a step every 4 and one for the last partial group.
    assert trainer.global_step == 3


def test_accumulating_two_halves_equals_one_full_batch(tmp_path: Path) -> None:
    full, halves = LinearModel(), LinearModel()
    _trainer(tmp_path, max_epochs=1).fit(full, loader(32))
    _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(halves, loader(16))
    torch.testing.assert_close(flat_weights(full), flat_weights(halves), rtol=1e-5, atol=1e-6)


def test_max_steps_and_val_check_interval(tmp_path: Path) -> None:
    class Counting(LinearModel):
        validations = 0

        def on_validation_epoch_end(self) -> None:
            self.validations += 1

    model = Counting()
    trainer = _trainer(
        tmp_path,
        max_epochs=None,
        max_steps=20,
        val_check_interval=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader(16), loader(16))
    assert trainer.global_step == 20
    assert model.validations == 5


def test_bf16_mixed_precision_trains(tmp_path: Path) -> None:
    model = LinearModel()
    _trainer(tmp_path, precision="bf16-mixed").fit(model, loader(16))
    assert model.losses[-1] < model.losses[0]


def test_resume_reaches_the_same_weights(tmp_path: Path) -> None:
    straight = LinearModel()
    torch.manual_seed(7)
    _trainer(tmp_path, max_epochs=4).fit(straight, loader(16, shuffle=True))

    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = LinearModel()
    torch.manual_seed(7)
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(first, loader(16, shuffle=True))
    resumed = LinearModel()
    resumed.layer.weight.data.zero_()
    torch.manual_seed(999)  # the checkpoint's RNG state, not this seed, decides the order
    _trainer(tmp_path, max_epochs=4).fit(
        resumed, loader(16, shuffle=True), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )
    torch.testing.assert_close(flat_weights(resumed), flat_weights(straight))


class SaveMidEpoch(accord.callbacks.Callback):
    """Writes a checkpoint after batch 5 of epoch 1."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 1 and batch_idx == 5:
            trainer.save_checkpoint(self.path)


def test_resume_from_the_middle_of_an_epoch(tmp_path: Path) -> None:
    straight = LinearModel()
    torch.manual_seed(7)
    _trainer(tmp_path, max_epochs=3).fit(straight, loader(16, shuffle=True))

    path = tmp_path / "mid.ckpt"
    first = LinearModel()
    torch.manual_seed(7)
    _trainer(tmp_path, max_epochs=3, callbacks=[SaveMidEpoch(path)]).fit(
        first, loader(16, shuffle=True)
    )
    resumed = LinearModel()
    torch.manual_seed(999)  # the checkpoint, not this seed, must decide what comes next
    _trainer(tmp_path, max_epochs=3).fit(resumed, loader(16, shuffle=True), ckpt_path=path)
    torch.testing.assert_close(flat_weights(resumed), flat_weights(straight))


def test_model_checkpoint_keeps_the_best_k(tmp_path: Path) -> None:
    class Scored(LinearModel):
        scores = (3.0, 1.0, 2.0, 0.5, 4.0)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("score", self.scores[self.current_epoch])

    callback = ModelCheckpoint(
        dirpath=tmp_path / "best",
        monitor="score",
        save_top_k=2,
        filename="{epoch}-{score:.1f}",
        save_last=True,
    )
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[callback], limit_val_batches=1)
    trainer.fit(Scored(), loader(64), loader(64))
    names = sorted(p.name for p in (tmp_path / "best").iterdir())
    assert names == ["epoch=1-score=1.0.ckpt", "epoch=3-score=0.5.ckpt", "last.ckpt"]
    assert callback.best_model_path.endswith("epoch=3-score=0.5.ckpt")
    assert callback.best_model_score == pytest.approx(0.5)
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "best").iterdir())


def test_csv_logger_writes_every_metric(tmp_path: Path) -> None:
    logger = accord.loggers.CSVLogger(tmp_path, name="run")
    trainer = _trainer(tmp_path, logger=logger, log_every_n_steps=4)
    trainer.fit(LinearModel(), loader(16), loader(64))
    text = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = text[0].split(",")
    assert {"step", "train_loss_step", "train_loss_epoch", "val_loss"} <= set(header)
    assert len(text) > 8


def test_tensorboard_logger_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = accord.loggers.TensorBoardLogger(tmp_path, name="tb")
    _trainer(tmp_path, logger=logger).fit(LinearModel(), loader(16))
    assert any(p.name.startswith("events.out") for p in (tmp_path / "tb" / "version_0").iterdir())


def test_progress_bar_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trainer(tmp_path, enable_progress_bar=True, max_epochs=1).fit(
        LinearModel(), loader(16), loader(64)
    )
    assert "Epoch 0" in capsys.readouterr().err
