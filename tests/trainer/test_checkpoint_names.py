"""`ModelCheckpoint` names and directories as Lightning's: ``name=value`` file names, the
logger's ``version_N/checkpoints`` directory (rank zero's on every rank), version
counters, weights-only files, ``save_last="link"``, and ``ckpt_path="last"`` across a
restart's new log version."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import ModelCheckpoint
from accord.errors import CheckpointError, ConfigurationError
from accord.loggers import CSVLogger, Logger, TensorBoardLogger
from accord.testing import run_distributed
from accord.trainer.preemption import PREEMPTION_CHECKPOINT_NAME
from tests.helpers.models import LinearModel, flat_weights, loader


class Scored(LinearModel):
    """Logs ``val_loss`` (and ``val/loss``) from a fixed list, one value per epoch."""

    SCORES = (0.5, 0.25, 0.375, 0.125, 0.75)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        value = self.SCORES[self.current_epoch % len(self.SCORES)]
        self.log("val_loss", value)
        self.log("val/loss", value)


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("logger", False)
    return accord.Trainer(default_root_dir=root, enable_progress_bar=False, **kwargs)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------- names


def test_the_lightning_pattern_is_found_by_the_lightning_glob(tmp_path: Path) -> None:
    callback = ModelCheckpoint(monitor="val_loss", filename="{epoch}-{val_loss:.4f}", save_top_k=2)
    trainer = _trainer(tmp_path, logger=CSVLogger(tmp_path), max_epochs=4, callbacks=[callback])
    trainer.fit(Scored(), loader(64), loader(64))
    # A user's script: the best two of 0.5, 0.25, 0.375, 0.125.
    found = sorted(tmp_path.glob("*/version_*/checkpoints/epoch=*-val_loss=*.ckpt"))
    assert [p.name for p in found] == [
        "epoch=1-val_loss=0.2500.ckpt",
        "epoch=3-val_loss=0.1250.ckpt",
    ]
    assert found[0].parent == tmp_path / "logs" / "version_0" / "checkpoints"
    assert callback.dirpath == found[0].parent
    assert callback.best_model_path == str(found[1])
    assert callback.best_model_score is not None
    assert callback.best_model_score.item() == pytest.approx(0.125)
    assert callback.kth_best_model_path == str(found[0])
    assert float(callback.kth_value) == pytest.approx(0.25)
    assert {k: float(v) for k, v in callback.best_k_models.items()} == {
        str(found[0]): 0.25,
        str(found[1]): 0.125,
    }
    best = torch.load(callback.best_model_path, weights_only=True)
    assert (best["epoch"], best["global_step"]) == (3, 16)


def test_the_default_name_and_directory_without_a_logger(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(LinearModel(), loader(64))
    assert _names(tmp_path / "checkpoints") == ["epoch=0-step=4.ckpt"]


def test_a_string_version_is_the_directory_name(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="exp", version="run-a")
    trainer = _trainer(tmp_path, logger=logger, max_epochs=1)
    trainer.fit(LinearModel(), loader(64))
    assert _names(tmp_path / "exp" / "run-a" / "checkpoints") == ["epoch=0-step=4.ckpt"]
    assert logger.log_dir == tmp_path / "exp" / "run-a"
    assert (logger.log_dir / "metrics.csv").is_file()


def test_tensorboard_sub_dir_holds_the_events_not_the_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, name="tb", sub_dir="events")
    _trainer(tmp_path, logger=logger, max_epochs=1).fit(LinearModel(), loader(64))
    version = tmp_path / "tb" / "version_0"
    assert _names(version / "checkpoints") == ["epoch=0-step=4.ckpt"]
    assert any(p.name.startswith("events.out") for p in (version / "events").iterdir())


def test_a_metric_with_a_slash_makes_a_sub_directory_as_in_lightning(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(
        dirpath=directory, monitor="val/loss", filename="{epoch}-{val/loss:.2f}", save_last=True
    )
    trainer = _trainer(tmp_path, max_epochs=4, callbacks=[callback])
    trainer.fit(Scored(), loader(64), loader(64))
    # The replaced files went, and the directories they left empty with them.
    assert _names(directory) == ["epoch=3-val", "last.ckpt"]
    assert _names(directory / "epoch=3-val") == ["loss=0.12.ckpt"]
    assert callback.best_model_path == str(directory / "epoch=3-val" / "loss=0.12.ckpt")
    # Without the inserted names the file stays in dirpath.
    flat = ModelCheckpoint(
        dirpath=tmp_path / "flat",
        monitor="val/loss",
        filename="epoch{epoch}-loss{val/loss:.2f}",
        auto_insert_metric_name=False,
    )
    _trainer(tmp_path, max_epochs=2, callbacks=[flat]).fit(Scored(), loader(64), loader(64))
    assert _names(tmp_path / "flat") == ["epoch1-loss0.25.ckpt"]


def test_last_finds_a_checkpoint_in_a_sub_directory(tmp_path: Path) -> None:
    def saving() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=tmp_path / "ckpt", monitor="val/loss", filename="{epoch}-{val/loss:.2f}"
        )

    _trainer(tmp_path, max_epochs=2, callbacks=[saving()]).fit(Scored(), loader(64), loader(64))
    resumed = _trainer(tmp_path, max_epochs=3, callbacks=[saving()])
    resumed.fit(Scored(), loader(64), loader(64), ckpt_path="last")
    assert resumed.global_step == 12  # from epoch=1 (step 8): one more epoch


def test_format_checkpoint_name_and_the_names_lightning_exposes(tmp_path: Path) -> None:
    assert ModelCheckpoint.CHECKPOINT_JOIN_CHAR == "-"
    assert ModelCheckpoint.CHECKPOINT_EQUALS_CHAR == "="
    assert ModelCheckpoint.CHECKPOINT_NAME_LAST == "last"
    assert ModelCheckpoint.FILE_EXTENSION == ".ckpt"
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val_loss:.2f}")
    name = callback.format_checkpoint_name({"epoch": 2, "val_loss": 0.123456})
    assert name == str(tmp_path / "epoch=2-val_loss=0.12.ckpt")
    assert Path(callback.format_checkpoint_name({"epoch": 2}, filename="{epoch:03d}")).name == (
        "epoch=002.ckpt"
    )
    assert (
        Path(callback.format_checkpoint_name({}, filename="{missing:d}")).name == "missing=0.ckpt"
    )
    versioned = callback.format_checkpoint_name({"epoch": 1, "val_loss": 1.0}, ver=2, prefix="p")
    assert Path(versioned).name == "p-epoch=1-val_loss=1.00-v2.ckpt"
    assert ModelCheckpoint().format_checkpoint_name({"epoch": 0, "step": 4}) == (
        "epoch=0-step=4.ckpt"
    )
    bare = ModelCheckpoint(filename="{epoch}-{step}", auto_insert_metric_name=False)
    assert bare.format_checkpoint_name({"epoch": 0, "step": 4}) == "0-4.ckpt"


def test_a_field_that_is_never_logged_is_refused(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}-{val_acc:.2f}")
    with pytest.raises(ConfigurationError, match=r"\['val_acc'\], which are not logged"):
        _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(LinearModel(), loader(64))
    wrong_spec = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}-{val_loss:d}")
    with pytest.raises(ConfigurationError, match="does not format with the logged values"):
        _trainer(tmp_path, max_epochs=1, callbacks=[wrong_spec]).fit(
            Scored(), loader(64), loader(64)
        )


# ----------------------------------------------------------- version counter


def test_a_name_already_taken_gets_a_version_suffix(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(
        dirpath=directory, filename="fixed", monitor="val_loss", save_top_k=-1
    )
    _trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(Scored(), loader(64), loader(64))
    assert _names(directory) == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"]
    steps = [torch.load(directory / n, weights_only=True)["global_step"] for n in _names(directory)]
    assert steps == [8, 12, 4]


def test_without_the_counter_the_name_is_overwritten(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(
        dirpath=directory,
        filename="fixed",
        monitor="val_loss",
        save_top_k=-1,
        enable_version_counter=False,
    )
    _trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(Scored(), loader(64), loader(64))
    assert _names(directory) == ["fixed.ckpt"]
    assert torch.load(directory / "fixed.ckpt", weights_only=True)["global_step"] == 12
    assert list(callback.best_k_models) == [str(directory / "fixed.ckpt")]


def test_a_second_run_in_the_same_directory_keeps_the_first_runs_files(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    for _ in range(2):
        callback = ModelCheckpoint(dirpath=directory, save_last=True)
        _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(LinearModel(), loader(64))
    assert _names(directory) == [
        "epoch=0-step=4-v1.ckpt",
        "epoch=0-step=4.ckpt",
        "last-v1.ckpt",
        "last.ckpt",
    ]
    assert callback.last_model_path == str(directory / "last-v1.ckpt")


# ----------------------------------------------------------- weights only


def test_save_weights_only_writes_what_load_from_checkpoint_needs(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=directory, save_weights_only=True, save_last=True)
    trained = LinearModel()
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(trained, loader(64))
    saved = torch.load(directory / "last.ckpt", weights_only=True)
    assert saved["weights_only"] is True
    assert {"state_dict", "epoch", "global_step", "hyper_parameters"} <= set(saved)
    assert not {"optimizer_states", "lr_schedulers", "callbacks", "rng"} & set(saved)
    loaded = LinearModel.load_from_checkpoint(directory / "last.ckpt")
    torch.testing.assert_close(flat_weights(loaded), flat_weights(trained))
    # Evaluating from it works; resuming a fit from it is refused, saying why.
    _trainer(tmp_path, enable_checkpointing=False).validate(
        LinearModel(), loader(64), ckpt_path=directory / "last.ckpt"
    )
    with pytest.raises(CheckpointError, match="holds weights only"):
        _trainer(tmp_path, max_epochs=3, enable_checkpointing=False).fit(
            LinearModel(), loader(64), ckpt_path=directory / "last.ckpt"
        )


def test_last_resumes_from_a_full_checkpoint_not_a_weights_only_one(tmp_path: Path) -> None:
    def callbacks() -> list[ModelCheckpoint]:
        # The weights-only files are written after the full one, so they are the newest.
        return [
            ModelCheckpoint(dirpath=tmp_path / "full", every_n_train_steps=4),
            ModelCheckpoint(dirpath=tmp_path / "weights", save_weights_only=True, save_last=True),
        ]

    _trainer(tmp_path, max_epochs=1, callbacks=callbacks()).fit(LinearModel(), loader(64))
    resumed = _trainer(tmp_path, max_epochs=2, callbacks=callbacks())
    resumed.fit(LinearModel(), loader(64), ckpt_path="last")
    assert resumed.global_step == 8


def test_last_with_weights_only_saving_resumes_from_a_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    def weights() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "weights", save_weights_only=True)

    _trainer(tmp_path, max_epochs=1, callbacks=[weights()]).fit(LinearModel(), loader(64))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        _trainer(tmp_path, max_epochs=2, callbacks=[weights()]).fit(
            LinearModel(), loader(64), ckpt_path="last"
        )
    # What a preemption leaves in the callback's directory: a full checkpoint.
    _trainer(tmp_path / "full", max_epochs=1).fit(LinearModel(), loader(64))
    full = tmp_path / "full" / "checkpoints" / "epoch=0-step=4.ckpt"
    (tmp_path / "weights" / PREEMPTION_CHECKPOINT_NAME).write_bytes(full.read_bytes())
    resumed = _trainer(tmp_path, max_epochs=2, callbacks=[weights()])
    resumed.fit(LinearModel(), loader(64), ckpt_path="last")
    assert resumed.global_step == 8


# ------------------------------------------------------------- save_last="link"


def test_save_last_link_points_at_the_newest_checkpoint_file(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_last="link")
    _trainer(tmp_path, max_epochs=4, callbacks=[callback]).fit(Scored(), loader(64), loader(64))
    last = directory / "last.ckpt"
    # Epoch 3 (0.125) was the last checkpoint file written; the link was switched each time.
    assert last.is_symlink()
    assert last.readlink() == Path("epoch=3-step=16.ckpt")
    assert _names(directory) == ["epoch=3-step=16.ckpt", "last.ckpt"]
    assert callback.last_model_path == str(last)
    resumed = _trainer(tmp_path, max_epochs=5)
    resumed.fit(LinearModel(), loader(64), loader(64), ckpt_path=last)
    assert resumed.global_step == 20


def test_save_last_link_without_top_k_files_writes_a_file(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=directory, save_top_k=0, save_last="link")
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(LinearModel(), loader(64))
    assert _names(directory) == ["last.ckpt"]
    assert not (directory / "last.ckpt").is_symlink()


# ------------------------------------------------------------------ the rest


def test_verbose_says_what_each_save_did(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", verbose=True)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(Scored(), loader(64), loader(64))
    text = caplog.text
    assert "'val_loss' reached 0.25000 (best 0.25000), saving model to" in text
    assert "Epoch 2, global step 12: 'val_loss' was not in top 1" in text


def test_to_yaml_writes_the_top_k_scores(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=2)
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(Scored(), loader(64), loader(64))
    callback.to_yaml()
    lines = (directory / "best_k_models.yaml").read_text().splitlines()
    assert lines == [
        f'"{directory / "epoch=0-step=4.ckpt"}": 0.5',
        f'"{directory / "epoch=1-step=8.ckpt"}": 0.25',
    ]


def test_save_on_exception_and_unknown_save_last_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="save_on_exception=True"):
        ModelCheckpoint(save_on_exception=True)
    with pytest.raises(ConfigurationError, match="'link'"):
        ModelCheckpoint(save_last="symlink")  # type: ignore[arg-type]


class _Recording(Logger):
    """A logger written for Lightning: name and version properties, no save_dir."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[tuple[str, str]] = []

    @property
    def name(self) -> str:
        return "custom"

    @property
    def version(self) -> str:
        return "0.1"

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        self.saved.append(
            (checkpoint_callback.best_model_path, checkpoint_callback.last_model_path)
        )


def test_a_logger_without_save_dir_puts_checkpoints_under_default_root_dir(tmp_path: Path) -> None:
    logger = _Recording()
    callback = ModelCheckpoint(every_n_epochs=1, save_last=True)
    _trainer(tmp_path, logger=logger, max_epochs=2, callbacks=[callback]).fit(
        LinearModel(), loader(64)
    )
    directory = tmp_path / "custom" / "0.1" / "checkpoints"
    assert _names(directory) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    # Called after each file written: the top-k one, then last.ckpt, at both epochs.
    first, second, last = (
        str(directory / n) for n in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt")
    )
    assert logger.saved == [(first, ""), (first, last), (second, last), (second, last)]


# ------------------------------------------------------- last across versions


def test_last_after_a_restart_finds_the_previous_versions_checkpoint(tmp_path: Path) -> None:
    first = _trainer(tmp_path, logger=CSVLogger(tmp_path), max_epochs=1)
    first.fit(LinearModel(), loader(64))
    previous = tmp_path / "logs" / "version_0" / "checkpoints"
    assert _names(previous) == ["epoch=0-step=4.ckpt"]
    # A new run numbers a new version; "last" still finds the previous version's file.
    second = _trainer(tmp_path, logger=CSVLogger(tmp_path), max_epochs=2)
    with pytest.warns(UserWarning, match="only best_model_path is restored"):
        second.fit(LinearModel(), loader(64), ckpt_path="last")
    assert second.global_step == 8
    assert _names(tmp_path / "logs" / "version_1" / "checkpoints") == ["epoch=1-step=8.ckpt"]
    assert _names(previous) == ["epoch=0-step=4.ckpt"]  # the other run's file is kept


def test_a_pinned_version_looks_in_its_own_directory_only(tmp_path: Path) -> None:
    _trainer(tmp_path, logger=CSVLogger(tmp_path), max_epochs=1).fit(LinearModel(), loader(64))
    pinned = _trainer(tmp_path, logger=CSVLogger(tmp_path, version=5), max_epochs=2)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "logs" / "version_5"))):
        pinned.fit(LinearModel(), loader(64), ckpt_path="last")


# ------------------------------------------------------------ two DDP ranks


def _fit_with_versions_apart(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # Rank 1's logger is pinned to another version, as if it had numbered its own.
    logger = CSVLogger(root, version=7 if rank == 1 else None)
    callback = ModelCheckpoint(
        monitor="val_loss", filename="{epoch}-{val_loss:.4f}", save_last=True
    )
    trainer = _trainer(
        Path(root),
        strategy="ddp",
        devices=world_size,
        logger=logger,
        max_epochs=2,
        callbacks=[callback],
    )
    trainer.fit(Scored(), loader(16), loader(16))
    return {
        "dirpath": str(callback.dirpath),
        "best": callback.best_model_path,
        "last": callback.last_model_path,
    }


@pytest.mark.timeout(300)
def test_every_rank_writes_to_rank_zeros_version_directory(tmp_path: Path) -> None:
    results = run_distributed(_fit_with_versions_apart, 2, str(tmp_path), timeout=240)
    directory = tmp_path / "logs" / "version_0" / "checkpoints"
    assert [r["dirpath"] for r in results] == [str(directory)] * 2
    assert results[0] == results[1]
    assert _names(directory) == ["epoch=1-val_loss=0.2500.ckpt", "last.ckpt"]
    assert not (tmp_path / "logs" / "version_7").exists()
