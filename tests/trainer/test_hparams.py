"""Hyperparameters: save_hyperparameters, self.hparams, checkpoints, the run directory,
and Module.load_from_checkpoint (loading as safely as every other path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accord
from accord.errors import CheckpointError, ConfigurationError
from accord.loggers import CSVLogger
from tests.helpers.models import loader


class Regressor(accord.Module):
    """A linear layer of a configurable width; records every ``__init__`` argument."""

    def __init__(self, features: int = 8, lr: float = 0.1, *, hidden: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(root: Path, model: accord.Module) -> accord.Trainer:
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=3,
        enable_progress_bar=False,
        default_root_dir=root,
        logger=CSVLogger(root),
    )
    trainer.fit(model, loader(16))
    return trainer


def test_save_hyperparameters_records_the_init_arguments() -> None:
    model = Regressor(8, hidden=6)
    assert model.hparams == {"features": 8, "lr": 0.1, "hidden": 6}
    assert model.hparams.hidden == 6

    class Picky(accord.Module):
        def __init__(self, a: int, b: nn.Module, **extra: Any) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["b"])

    assert Picky(1, nn.Linear(1, 1), c=3).hparams == {"a": 1, "c": 3}

    class Named(accord.Module):
        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    assert Named(1, 2).hparams == {"b": 2}

    class Given(accord.Module):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": 3})

    assert Given().hparams.width == 3
    with pytest.raises(AttributeError, match="No hyperparameter 'depth'"):
        _ = Given().hparams.depth

    class Wrong(accord.Module):
        def __init__(self, a: int) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    with pytest.raises(ConfigurationError, match=r"'b'.*not an argument of Wrong\.__init__"):
        Wrong(1)


def test_checkpoint_and_run_directory_hold_them(tmp_path: Path) -> None:
    trainer = _fit(tmp_path, Regressor(8, lr=0.05, hidden=5))
    assert trainer.checkpoint_callback is not None
    path = trainer.checkpoint_callback.best_model_path
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["hyper_parameters"] == {"features": 8, "lr": 0.05, "hidden": 5}
    saved = json.loads((trainer.log_dir / "hparams.json").read_text())
    assert saved == {"features": 8, "lr": 0.05, "hidden": 5}
    assert trainer.log_dir == tmp_path / "logs" / "version_0"


def test_load_from_checkpoint_rebuilds_the_module(tmp_path: Path) -> None:
    model = Regressor(8, lr=0.05, hidden=5)
    trainer = _fit(tmp_path, model)
    assert trainer.checkpoint_callback is not None
    path = trainer.checkpoint_callback.best_model_path

    loaded = Regressor.load_from_checkpoint(path)
    assert loaded.hparams == {"features": 8, "lr": 0.05, "hidden": 5}
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    # An override of a training setting keeps the weights.
    tuned = Regressor.load_from_checkpoint(path, lr=0.001)
    assert tuned.hparams.lr == 0.001
    assert torch.equal(tuned.net[0].weight, model.net[0].weight)

    # An override that changes the shapes is refused, saying what it was built with.
    with pytest.raises(CheckpointError, match=r"does not fit Regressor\(.*hidden=7"):
        Regressor.load_from_checkpoint(path, hidden=7)


class Activation(accord.Module):
    """Takes a class as a hyperparameter: not a plain value."""

    def __init__(self, act: type[nn.Module] = nn.ReLU, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 1)
        self.act = act()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.act(self.layer(x)).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_objects_stay_out_of_checkpoints_so_loading_stays_safe(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"\['act'\] of Activation are not plain values"):
        model = Activation(nn.Tanh)
    assert model.hparams.act is nn.Tanh
    trainer = _fit(tmp_path, model)
    assert trainer.checkpoint_callback is not None
    path = trainer.checkpoint_callback.best_model_path
    assert torch.load(path, weights_only=True)["hyper_parameters"] == {"width": 8}
    with pytest.warns(UserWarning, match="not plain values"):
        loaded = Activation.load_from_checkpoint(path, act=nn.Tanh)
    assert isinstance(loaded.act, nn.Tanh)
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    # A fit resumes from it with the safe loader.
    with pytest.warns(UserWarning, match="not plain values"):
        resumed = Activation(nn.Tanh)
    again = accord.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=3,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=tmp_path / "resume",
    )
    again.fit(resumed, loader(16), ckpt_path=path)
    assert again.global_step == 6


def test_loading_is_safe_by_default(tmp_path: Path) -> None:
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"act": nn.ReLU}}, unsafe)
    with pytest.raises(CheckpointError, match="weights_only=True refuses"):
        Activation.load_from_checkpoint(unsafe)
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        Activation.load_from_checkpoint(tmp_path / "missing.ckpt")

    class Needs(accord.Module):
        def __init__(self, size: int) -> None:
            super().__init__()

    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}}, bare)
    with pytest.raises(CheckpointError, match="pass them as keyword arguments"):
        Needs.load_from_checkpoint(bare)
