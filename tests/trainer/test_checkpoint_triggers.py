"""When `ModelCheckpoint` saves (every N optimizer steps, every time interval) and which
checkpoint ``ckpt_path="best"`` names, in real runs."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import ModelCheckpoint
from accord.errors import CheckpointError, ConfigurationError
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, flat_weights, loader


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    return accord.Trainer(default_root_dir=root, logger=False, enable_progress_bar=False, **kwargs)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------ every_n_train_steps


def _every_three_steps(rank: int, world_size: int, root: str) -> dict[str, Any]:
    directory = Path(root) / "steps"
    # 256 samples, 16 per rank and batch: 8 batches per epoch, 4 optimizer steps.
    common: dict[str, Any] = {
        "strategy": "ddp",
        "devices": world_size,
        "max_epochs": 2,
        "accumulate_grad_batches": 2,
    }
    straight = LinearModel()
    callback = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)
    _trainer(Path(root), callbacks=[callback], **common).fit(straight, loader(16, shuffle=True))
    saved = {name: torch.load(directory / name, weights_only=True) for name in _names(directory)}
    torch.manual_seed(7)  # the checkpoint, not this seed, decides what comes next
    resumed = LinearModel()
    _trainer(Path(root) / "resumed", enable_checkpointing=False, **common).fit(
        resumed, loader(16, shuffle=True), ckpt_path=directory / "epoch=0-step=3.ckpt"
    )
    return {
        "names": list(saved),
        "positions": [(c["global_step"], c["batches_done"]) for c in saved.values()],
        "straight": flat_weights(straight),
        "resumed": flat_weights(resumed),
    }


@pytest.mark.timeout(300)
def test_every_n_train_steps_saves_after_the_optimizer_step_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_distributed(_every_three_steps, 2, str(tmp_path), timeout=240)
    for result in results:
        # Steps 3 and 6 only: no save at an epoch's end, none mid-accumulation.
        assert result["names"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
        assert result["positions"] == [(3, 6), (6, 4)]
        # Saved right after the step, so a resume from it continues exactly.
        torch.testing.assert_close(result["resumed"], result["straight"], rtol=0, atol=1e-6)
    torch.testing.assert_close(results[0]["straight"], results[1]["straight"])


def test_every_n_train_steps_on_one_device_keeps_the_newest(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(LinearModel(), loader(64))
    assert _names(tmp_path / "ckpt") == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert callback.best_model_path.endswith("epoch=1-step=8.ckpt")


# ------------------------------------------------------------ train_time_interval


def _rank_zero_clock(rank: int, world_size: int, root: str) -> list[str]:
    # As if the clocks disagreed: rank 0 finds the interval passed at every step, rank 1
    # never. Rank 0 decides, so both save together (a rank-local decision would hang).
    interval = timedelta(microseconds=1) if rank == 0 else timedelta(days=1)
    callback = ModelCheckpoint(
        dirpath=Path(root), train_time_interval=interval, save_top_k=-1, filename="{step}"
    )
    trainer = _trainer(
        Path(root), strategy="ddp", devices=world_size, max_epochs=1, callbacks=[callback]
    )
    trainer.fit(LinearModel(), loader(64))
    return sorted(callback.best_k_models)


@pytest.mark.timeout(200)
def test_train_time_interval_follows_rank_zero_clock(tmp_path: Path) -> None:
    saved = run_distributed(_rank_zero_clock, 2, str(tmp_path), timeout=150)
    # 256 samples, 64 per rank and batch: 2 optimizer steps, each followed by a save.
    expected = [str(tmp_path / f"step={step}.ckpt") for step in (1, 2)]
    assert saved == [expected, expected]
    assert _names(tmp_path) == ["step=1.ckpt", "step=2.ckpt"]


def test_train_time_interval_not_reached_saves_nothing(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", train_time_interval=timedelta(days=1))
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(LinearModel(), loader(64))
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ ckpt_path="best"


class Scored(LinearModel):
    """Logs a fixed score per epoch (best at epoch 1) and notes what it was loaded from."""

    SCORES = (3.0, 1.0, 2.0)

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, int] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", self.SCORES[min(self.current_epoch, len(self.SCORES) - 1)])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = {"epoch": checkpoint["epoch"], "global_step": checkpoint["global_step"]}


def test_best_loads_the_best_checkpoint_in_every_stage(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="score", save_last=True)
    trainer = _trainer(tmp_path, max_epochs=3, callbacks=[callback], limit_val_batches=1)
    trainer.fit(Scored(), loader(64), loader(64))
    assert _names(tmp_path / "ckpt") == ["epoch=1-step=8.ckpt", "last.ckpt"]
    best = {"epoch": 1, "global_step": 8}
    for stage in ("validate", "test", "predict"):
        model = Scored()
        getattr(trainer, stage)(model, loader(64), ckpt_path="best")
        assert model.loaded == best, stage
    resumed = Scored()
    trainer.fit(resumed, loader(64), loader(64), ckpt_path="best")
    assert resumed.loaded == best
    assert trainer.global_step == 12  # epoch 2 again, from the best checkpoint


def test_best_without_a_model_checkpoint_says_so(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    with pytest.raises(CheckpointError, match=r"ckpt_path='best' needs a ModelCheckpoint"):
        trainer.validate(LinearModel(), loader(64), ckpt_path="best")


def test_best_before_any_save_says_so(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match=r"has no best checkpoint yet"):
        trainer.test(LinearModel(), loader(64), ckpt_path="best")
    with pytest.raises(CheckpointError, match=r"has no best checkpoint yet"):
        trainer.fit(LinearModel(), loader(64), ckpt_path="best")


# ------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, r"every_n_epochs and every_n_train"),
        ({"every_n_train_steps": 2, "train_time_interval": timedelta(hours=1)}, r"pick one"),
        ({"every_n_train_steps": -1}, r"every_n_train_steps=-1\) must be an int >= 0"),
        ({"every_n_epochs": -2}, r"every_n_epochs=-2\) must be an int >= 0"),
        ({"train_time_interval": timedelta(0)}, r"positive datetime.timedelta"),
        ({"train_time_interval": 60}, r"positive datetime.timedelta"),
    ],
)
def test_bad_trigger_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ModelCheckpoint(**kwargs)
