"""DataModule: Lightning's hooks in order, on the right ranks, and its state in checkpoints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.errors import ConfigurationError
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, regression_data


class RegressionData(accord.DataModule):
    """Writes its data in prepare_data and reads it back in setup, recording each call."""

    def __init__(self, root: Path, batch_size: int = 16) -> None:
        super().__init__()
        self.root = root
        self.batch_size = batch_size
        self.calls: list[str] = []
        self.data: TensorDataset | None = None
        self.resumed_from: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")
        # Slow on purpose: a rank that skipped the barrier would read before the file exists.
        time.sleep(0.5)
        data = regression_data(64)
        torch.save({"x": data.tensors[0], "y": data.tensors[1]}, self.root / "data.pt")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")
        saved = torch.load(self.root / "data.pt", weights_only=True)
        self.data = TensorDataset(saved["x"], saved["y"])

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")

    def _loader(self) -> DataLoader[Any]:
        assert self.data is not None, "setup() was not called before the loader"
        return DataLoader(self.data, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader[Any]:
        self.calls.append("train_dataloader")
        return self._loader()

    def val_dataloader(self) -> DataLoader[Any]:
        self.calls.append("val_dataloader")
        return self._loader()

    def test_dataloader(self) -> DataLoader[Any]:
        self.calls.append("test_dataloader")
        return self._loader()

    def predict_dataloader(self) -> DataLoader[Any]:
        self.calls.append("predict_dataloader")
        return self._loader()

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "calls": len(self.calls)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resumed_from = state_dict


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "default_root_dir": root,
        **kwargs,
    }
    return accord.Trainer(**settings)


def test_fit_validate_test_predict_call_the_hooks_in_order(tmp_path: Path) -> None:
    dm = RegressionData(tmp_path)
    model = LinearModel()
    trainer = _trainer(tmp_path)
    trainer.fit(model, datamodule=dm)
    assert dm.calls == [
        "prepare_data",
        "setup:fit",
        # As in Lightning: the sanity check asks for the validation loader first.
        "val_dataloader",
        "train_dataloader",
        "teardown:fit",
    ]
    assert trainer.global_step == 4
    assert trainer.datamodule is dm and dm.trainer is trainer
    assert "val_loss" in trainer.callback_metrics

    dm.calls.clear()
    [metrics] = trainer.validate(model, datamodule=dm)
    assert "val_loss" in metrics
    trainer.test(model, dm)  # in place of the loaders, as Lightning accepts it
    predictions = trainer.predict(model, datamodule=dm)
    assert dm.calls == [
        "prepare_data",
        "setup:validate",
        "val_dataloader",
        "teardown:validate",
        "prepare_data",
        "setup:test",
        "test_dataloader",
        "teardown:test",
        "prepare_data",
        "setup:predict",
        "predict_dataloader",
        "teardown:predict",
    ]
    assert sum(len(p) for p in predictions) == 64


def test_loaders_and_a_datamodule_together_are_refused(tmp_path: Path) -> None:
    dm = RegressionData(tmp_path)
    loader = DataLoader(regression_data(16), batch_size=4)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigurationError, match="both dataloaders and a datamodule"):
        trainer.fit(LinearModel(), loader, datamodule=dm)
    with pytest.raises(ConfigurationError, match="both dataloaders and a datamodule"):
        trainer.fit(LinearModel(), dm, datamodule=dm)
    with pytest.raises(ConfigurationError, match="both dataloaders and a datamodule"):
        trainer.test(LinearModel(), loader, datamodule=dm)
    with pytest.raises(ConfigurationError, match=r"must be an accord\.DataModule"):
        trainer.fit(LinearModel(), datamodule=loader)  # type: ignore[arg-type]
    assert dm.calls == []


def test_a_datamodule_without_the_stage_loader_says_so(tmp_path: Path) -> None:
    class TrainOnly(accord.DataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(regression_data(16), batch_size=4)

    trainer = _trainer(tmp_path)
    trainer.fit(LinearModel(), datamodule=TrainOnly())
    with pytest.raises(ConfigurationError, match="no test_dataloader"):
        trainer.test(LinearModel(), datamodule=TrainOnly())


def test_datamodule_state_travels_in_checkpoints(tmp_path: Path) -> None:
    dm = RegressionData(tmp_path, batch_size=8)
    trainer = _trainer(tmp_path, enable_checkpointing=True)
    trainer.fit(LinearModel(), datamodule=dm)
    path = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["datamodule"] == {"batch_size": 8, "calls": 4}

    resumed = RegressionData(tmp_path, batch_size=8)
    _trainer(tmp_path, max_epochs=2).fit(LinearModel(), datamodule=resumed, ckpt_path=path)
    assert resumed.resumed_from == {"batch_size": 8, "calls": 4}


def _fit_two_ranks(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    dm = RegressionData(root)
    trainer = _trainer(root, strategy="ddp", devices=2)
    trainer.fit(LinearModel(), datamodule=dm)
    return {"calls": dm.calls, "steps": trainer.global_step}


def test_prepare_data_runs_on_local_rank_zero_then_every_rank_sets_up(tmp_path: Path) -> None:
    results = run_distributed(_fit_two_ranks, 2, tmp_path, timeout=240)
    assert results[0]["calls"][:2] == ["prepare_data", "setup:fit"]
    # Rank 1 never prepares, and its setup read the file rank 0 wrote (the barrier).
    assert results[1]["calls"][0] == "setup:fit"
    assert "prepare_data" not in results[1]["calls"]
    # 64 samples over 2 ranks in batches of 16: 2 steps each.
    assert [r["steps"] for r in results] == [2, 2]
