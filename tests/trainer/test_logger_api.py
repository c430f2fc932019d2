"""The loggers' Lightning interface: directories and versions, ``experiment``, prefixes,
flushing, ``log_graph``, TensorBoard's HParams view, and a logger written for Lightning."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import accord
from accord.errors import ConfigurationError
from accord.loggers import CSVLogger, Logger, TensorBoardLogger
from accord.loggers.csv import ExperimentWriter
from accord.loggers.logger import add_prefix, next_version, version_directory
from tests.helpers.models import LinearModel, loader


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_csv_logger_directories_and_versions(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="exp")
    assert (logger.save_dir, logger.name, logger.root_dir) == (tmp_path, "exp", tmp_path / "exp")
    assert logger.auto_version
    assert logger.version == 0
    assert logger.log_dir == tmp_path / "exp" / "version_0"
    assert logger.group_separator == "/"
    (tmp_path / "exp" / "version_3").mkdir(parents=True)
    assert CSVLogger(tmp_path, name="exp").version == 4
    named = CSVLogger(tmp_path, name="exp", version="baseline")
    assert not named.auto_version
    assert named.log_dir == tmp_path / "exp" / "baseline"
    # No name: the versions go straight into save_dir, as in Lightning.
    assert CSVLogger(tmp_path, name=None).log_dir == tmp_path / "version_0"
    assert (version_directory(2), version_directory("x")) == ("version_2", "x")
    assert next_version(tmp_path / "missing") == 0


def test_csv_logger_experiment_is_its_writer(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, prefix="train", flush_logs_every_n_steps=2)
    writer = logger.experiment
    assert isinstance(writer, ExperimentWriter)
    assert writer.log_dir == logger.log_dir
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=0)
    assert not logger.metrics_file.exists()  # step 0: (0 + 1) % 2 != 0
    logger.log_metrics({"loss": 0.25, "acc": 1}, step=1)  # flushed at step 1
    assert [r for r in _rows(logger.metrics_file)] == [
        {"step": "0", "train-loss": "0.5", "train-acc": ""},
        {"step": "1", "train-loss": "0.25", "train-acc": "1"},
    ]
    writer.log_metrics({"other": 3.0}, step=2)  # through the writer: no prefix
    logger.save()
    assert _rows(logger.metrics_file)[-1] == {
        "step": "2",
        "train-loss": "",
        "train-acc": "",
        "other": "3.0",
    }
    writer.log_hparams({"lr": 0.1})
    logger.log_hyperparams({"width": 4})
    assert json.loads((logger.log_dir / "hparams.json").read_text()) == {"lr": 0.1, "width": 4}


def test_csv_logger_refuses_a_flush_interval_below_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="flush_logs_every_n_steps=0"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_add_prefix() -> None:
    assert add_prefix({"a": 1}, "") == {"a": 1}
    assert add_prefix({"a": 1}, "p") == {"p-a": 1}
    assert add_prefix({"a": 1}, "p", "/") == {"p/a": 1}


class _LightningStyle(Logger):
    """Written for Lightning: properties for name and version, no ``__init__`` of its own."""

    rows: ClassVar[list[tuple[dict[str, float], int | None]]] = []

    @property
    def name(self) -> str:
        return "mine"

    @property
    def version(self) -> str:
        return "v1"

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        self.rows.append((dict(metrics), step))


def test_a_logger_written_for_lightning_runs_a_fit(tmp_path: Path) -> None:
    logger = _LightningStyle()
    assert logger.save_dir is None and logger.root_dir is None
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(LinearModel(), loader(64))
    assert [step for _, step in logger.rows][:4] == [0, 1, 2, 3]
    assert (tmp_path / "mine" / "v1" / "checkpoints" / "epoch=0-step=4.ckpt").is_file()
    logger.log_graph(LinearModel())  # nothing to do for this logger
    logger.after_save_checkpoint(accord.callbacks.ModelCheckpoint())


# ---------------------------------------------------------------- TensorBoard


def _events(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return accumulator


class _GraphAtFitStart(accord.callbacks.Callback):
    def on_fit_start(self, trainer: accord.Trainer, module: Any) -> None:
        assert trainer.logger is not None
        trainer.logger.log_graph(module, torch.randn(2, 8))


def test_tensorboard_logger_prefix_graph_and_hparams(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, name="tb", log_graph=True, prefix="run", sub_dir="ev")
    assert logger.log_dir == tmp_path / "tb" / "version_0" / "ev"
    assert logger.sub_dir == "ev"
    assert type(logger.experiment).__name__ == "SummaryWriter"
    logger.log_hyperparams({"lr": 0.1, "net": {"width": 4}, "act": torch.nn.ReLU})
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[_GraphAtFitStart()],
        enable_progress_bar=False,
    )
    trainer.fit(LinearModel(), loader(64))
    events = _events(logger.log_dir)
    tags = events.Tags()
    assert "run-train_loss_step" in tags["scalars"]
    assert [e.value for e in events.Scalars("run-hp_metric")] == [-1.0]
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")
    assert tags["graph"]
    # Outside a run a Module cannot be traced (its trainer is unset): said so.
    with pytest.raises(ConfigurationError, match="during a run"):
        TensorBoardLogger(tmp_path, log_graph=True).log_graph(LinearModel(), torch.randn(2, 8))


def test_tensorboard_hparams_without_the_placeholder_metric(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_hyperparams({"lr": 0.1}, metrics={"val_loss": 0.5}, step=2)
    logger.finalize("success")
    events = _events(logger.log_dir)
    assert "hp_metric" not in events.Tags()["scalars"]
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(2, 0.5)]
    assert logger.hparams == {"lr": 0.1}


def test_tensorboard_log_graph_needs_an_input_and_the_option(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with pytest.warns(UserWarning, match="example_input_array"):
        TensorBoardLogger(tmp_path, log_graph=True).log_graph(LinearModel())
    off = TensorBoardLogger(tmp_path, version=1)
    off.log_graph(LinearModel(), torch.randn(2, 8))  # log_graph=False: nothing written
    assert off._writer is None


def test_tensorboard_logger_in_a_fit_keeps_its_version(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, name="tb", version="first")
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=logger,
        enable_progress_bar=False,
    )
    trainer.fit(LinearModel(), loader(64))
    assert trainer.log_dir == tmp_path / "tb" / "first"
    assert (tmp_path / "tb" / "first" / "checkpoints" / "epoch=0-step=4.ckpt").is_file()
