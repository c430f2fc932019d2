"""DataModule's Lightning names: save_hyperparameters / hparams (in checkpoints under
``"datamodule_hyper_parameters"``, merged with the module's for the loggers),
load_from_checkpoint, from_datasets, and the batch-transfer hooks' defaults."""

from __future__ import annotations

import inspect
import json
import pickle
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accord
from accord.errors import CheckpointError, ConfigurationError
from accord.hparams import log_hyperparameters, run_hyperparameters
from accord.loggers import CSVLogger
from tests.helpers.models import LinearModel, regression_data


class Data(accord.DataModule):
    """Regression data whose batch size and sample count are hyperparameters."""

    def __init__(self, batch_size: int = 16, samples: int = 64, transform: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="transform")
        self.transform = transform
        self.restored: dict[str, Any] | None = None

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(regression_data(self.hparams.samples), batch_size=self.hparams.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 3}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = state_dict


class Regressor(LinearModel):
    def __init__(self, lr: float = 0.1, batch_size: int = 16) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def _fit(root: Path, model: accord.Module, datamodule: accord.DataModule, **kwargs: Any) -> Path:
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        **kwargs,
    )
    trainer.fit(model, datamodule=datamodule)
    assert trainer.checkpoint_callback is not None
    return Path(trainer.checkpoint_callback.best_model_path)


def test_save_hyperparameters_as_a_module_does() -> None:
    data = Data(32)
    assert data.hparams == {"batch_size": 32, "samples": 64}
    assert data.hparams.batch_size == 32

    class Named(accord.DataModule):
        def __init__(self, a: int, b: int, **extra: Any) -> None:
            super().__init__()
            self.save_hyperparameters("a", "flag")

    assert Named(1, 2, flag=True).hparams == {"a": 1, "flag": True}

    class Given(accord.DataModule):
        def __init__(self, config: Namespace) -> None:
            super().__init__()
            self.save_hyperparameters(config)

    assert Given(Namespace(width=4)).hparams == {"width": 4}

    class FromFrame(accord.DataModule):
        def __init__(self, size: int) -> None:
            super().__init__()
            self._record(inspect.currentframe())

        def _record(self, frame: Any) -> None:
            self.save_hyperparameters(frame=frame, logger=False)

    quiet = FromFrame(5)
    assert quiet.hparams == {"size": 5}
    assert run_hyperparameters(None, quiet) == {}

    class Wrong(accord.DataModule):
        def __init__(self, a: int) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    with pytest.raises(ConfigurationError, match=r"not an argument of Wrong.__init__"):
        Wrong(1)


def test_an_object_stays_out_of_the_checkpoint_with_a_warning() -> None:
    class Holding(accord.DataModule):
        def __init__(self, net: nn.Module, size: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match=r"\['net'\] of Holding are not plain values"):
        holding = Holding(nn.Linear(1, 1))
    assert holding.hparams_for_checkpoint() == {"size": 2}


def test_hyperparameters_are_in_the_checkpoint_and_build_it_again(tmp_path: Path) -> None:
    path = _fit(tmp_path, LinearModel(), Data(32, samples=128, transform=abs))
    saved = torch.load(path, weights_only=True)
    assert saved[accord.DataModule.CHECKPOINT_HYPER_PARAMS_KEY] == {
        "batch_size": 32,
        "samples": 128,
    }
    assert saved["datamodule_hyper_parameters"] == {"batch_size": 32, "samples": 128}
    loaded = Data.load_from_checkpoint(path)
    assert isinstance(loaded, Data)
    assert loaded.hparams == {"batch_size": 32, "samples": 128}
    assert loaded.restored == {"seen": 3}
    assert Data.load_from_checkpoint(path, batch_size=8, transform=abs).hparams.batch_size == 8
    with pytest.raises(ConfigurationError, match="hparams_file"):
        Data.load_from_checkpoint(path, hparams_file=tmp_path / "hparams.yaml")

    class Other(accord.DataModule):
        def __init__(self, width: int) -> None:
            super().__init__()

    with pytest.raises(CheckpointError, match=r"Other could not be built"):
        Other.load_from_checkpoint(path)


def test_a_datamodule_without_hyperparameters_writes_no_key(tmp_path: Path) -> None:
    class Plain(accord.DataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(regression_data(64), batch_size=16)

    path = _fit(tmp_path, LinearModel(), Plain())
    assert "datamodule_hyper_parameters" not in torch.load(path, weights_only=True)
    assert isinstance(Plain.load_from_checkpoint(path), Plain)


def test_weights_only_checkpoints_keep_the_datamodule_hyperparameters(tmp_path: Path) -> None:
    callback = accord.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_weights_only=True)
    path = _fit(tmp_path, LinearModel(), Data(8), callbacks=[callback])
    saved = torch.load(path, weights_only=True)
    assert saved["datamodule_hyper_parameters"] == {"batch_size": 8, "samples": 64}
    assert "datamodule" not in saved
    assert Data.load_from_checkpoint(path).hparams.batch_size == 8


def test_the_loggers_get_the_module_and_datamodule_hyperparameters_merged(
    tmp_path: Path,
) -> None:
    model, data = Regressor(lr=0.05, batch_size=16), Data(16)
    assert run_hyperparameters(model, data) == {"lr": 0.05, "batch_size": 16, "samples": 64}
    assert run_hyperparameters(model, None) == {"lr": 0.05, "batch_size": 16}
    logger = CSVLogger(tmp_path)
    log_hyperparameters([logger], model, data)
    written = json.loads((logger.log_dir / "hparams.json").read_text())
    assert written == {"lr": 0.05, "batch_size": 16, "samples": 64}
    with pytest.raises(ConfigurationError, match=r"both save the hyperparameters \['batch_size'\]"):
        run_hyperparameters(Regressor(batch_size=32), Data(16))


def test_from_datasets_makes_the_loaders(tmp_path: Path) -> None:
    train, val = regression_data(64), regression_data(32, seed=1)
    data = Data.from_datasets(train, val, batch_size=8, samples=64)
    assert data.hparams == {"batch_size": 8, "samples": 64}  # batch_size reaches __init__
    loader = data.train_dataloader()
    assert isinstance(loader, DataLoader)
    assert loader.batch_size == 8
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert isinstance(data.val_dataloader().sampler, torch.utils.data.SequentialSampler)
    many = accord.DataModule.from_datasets(test_dataset=[train, val], batch_size=4)
    assert [len(loader) for loader in many.test_dataloader()] == [16, 8]
    pickle.loads(pickle.dumps(many))  # launchers that start processes pickle it
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(LinearModel(), datamodule=accord.DataModule.from_datasets(train, batch_size=16))
    assert trainer.global_step == 4


def test_the_hooks_lightning_names_have_its_defaults() -> None:
    data = accord.DataModule()
    assert data.name is None
    assert data.prepare_data_per_node is True
    assert accord.DataModule.CHECKPOINT_HYPER_PARAMS_NAME == "datamodule_hparams_name"
    assert accord.DataModule.CHECKPOINT_HYPER_PARAMS_TYPE == "datamodule_hparams_type"
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    assert data.on_before_batch_transfer(batch, 0) is batch
    assert data.on_after_batch_transfer(batch, 0) is batch
    moved = data.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved["x"].device.type == "meta" and moved["y"][0].device.type == "meta"
    data.on_exception(RuntimeError("boom"))

    class NoInit(accord.DataModule):
        def __init__(self) -> None:  # never calls super().__init__()
            pass

    assert NoInit().hparams == {}


class _Scaling(accord.DataModule):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return [t * 2 for t in batch]


class _MovesItself(LinearModel):
    moved: int = 0

    def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
        self.moved += 1
        return [t.to(device) for t in batch]


class _ScalingData(_Scaling):
    def train_dataloader(self) -> Any:
        return DataLoader(regression_data(16), batch_size=8)


def _quiet_trainer() -> accord.Trainer:
    return accord.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_each_batch_transfer_hook_comes_from_where_lightning_takes_it() -> None:
    model = _MovesItself()
    _quiet_trainer().fit(model, datamodule=_ScalingData())
    # The module's transfer (the datamodule has none) after the datamodule's scaling.
    assert model.moved == 2

    class AlsoMoves(_ScalingData):
        def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
            return [t.to(device) for t in batch]

    other = _MovesItself()
    with pytest.warns(UserWarning, match=r"both define transfer_batch_to_device\(\)"):
        _quiet_trainer().fit(other, datamodule=AlsoMoves())
    assert other.moved == 0, "the datamodule's wins"
