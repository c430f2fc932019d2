"""Mistakes that used to pass silently now say what happened, and the CSV log's step
and epoch columns are Lightning's."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.errors import ConfigurationError
from accord.loggers import CSVLogger
from tests.helpers.models import LinearModel, loader, regression_data


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": root,
        **kwargs,
    }
    return accord.Trainer(**settings)


class NoValidation(accord.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_val_loader_without_validation_step_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="does not define validation_step"):
        _trainer(tmp_path).fit(NoValidation(), loader(16), loader(16))

    class Data(accord.DataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return loader(16)

        def val_dataloader(self) -> DataLoader[Any]:
            return loader(16)

    with pytest.warns(UserWarning, match="NoValidation does not define validation_step"):
        _trainer(tmp_path).fit(NoValidation(), datamodule=Data())


def test_empty_training_data_is_an_error(tmp_path: Path) -> None:
    empty = DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0)), batch_size=4)
    with pytest.raises(ConfigurationError, match="training loader has no batches"):
        _trainer(tmp_path).fit(LinearModel(), empty)
    short = DataLoader(regression_data(3), batch_size=4, drop_last=True)
    with pytest.raises(ConfigurationError, match="smaller than one batch with drop_last"):
        _trainer(tmp_path).fit(LinearModel(), short)


def test_no_training_batches_allowed_warns_and_stops(tmp_path: Path) -> None:
    model = LinearModel()
    before = model.layer.weight.detach().clone()
    trainer = _trainer(tmp_path, limit_train_batches=0, max_epochs=3)
    with pytest.warns(UserWarning, match="limit_train_batches=0 leaves no training batch"):
        trainer.fit(model, loader(16))
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert torch.equal(model.layer.weight, before)


def test_fit_again_on_a_finished_run_warns(tmp_path: Path) -> None:
    model = LinearModel()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, loader(16))
    weights = model.layer.weight.detach().clone()
    with pytest.warns(
        UserWarning, match=r"fit\(\) did nothing: .*max_epochs=1 \(current_epoch=1\)"
    ):
        trainer.fit(model, loader(16))
    assert torch.equal(model.layer.weight, weights)
    capped = _trainer(tmp_path, max_steps=2)
    capped.fit(LinearModel(), loader(16))
    with pytest.warns(UserWarning, match=r"max_steps=2 \(global_step=2\)"):
        capped.fit(LinearModel(), loader(16))


def test_csv_rows_have_the_epoch_and_a_step_from_zero(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    trainer = _trainer(
        tmp_path, logger=logger, max_epochs=2, limit_train_batches=4, log_every_n_steps=1
    )
    trainer.fit(LinearModel(), loader(16), loader(16))
    assert trainer.log_dir == tmp_path / "logs" / "version_0" == logger.log_dir
    with logger.metrics_file.open() as handle:
        rows = list(csv.DictReader(handle))
    steps = [(int(r["epoch"]), int(r["step"])) for r in rows if r["train_loss_step"]]
    assert steps == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (1, 6), (1, 7)]
    # Epoch-end values are logged at the epoch's last step, as Lightning logs them.
    ends = [(int(r["epoch"]), int(r["step"])) for r in rows if r["val_loss"]]
    assert ends == [(0, 3), (1, 7)]
    trainer.validate(LinearModel(), loader(16))
    with logger.metrics_file.open() as handle:
        last = list(csv.DictReader(handle))[-1]
    assert (last["epoch"], last["step"]) == ("2", "8")
