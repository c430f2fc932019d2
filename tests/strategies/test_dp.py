"""DP regression tests: a real fit through torch.nn.DataParallel (one replica on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_utilities.core.rank_zero import WarningCache
from torch import nn

import accord
from accord.collectives import SingleDeviceCollective
from accord.engines.single import dp
from accord.errors import ConfigurationError
from accord.strategies import DPStrategy
from tests.helpers.models import LinearModel, flat_weights, loader


def _fit(strategy: str, tmp_path: Path) -> tuple[LinearModel, accord.Trainer]:
    model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader(32), loader(64))
    return model, trainer


def test_dp_fit_matches_single_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "_WARNINGS", WarningCache())  # as in a fresh process
    with pytest.warns(UserWarning, match="one replica"):
        dp_model, trainer = _fit("dp", tmp_path)
    single, _ = _fit("single_device", tmp_path)
    assert isinstance(trainer.strategy, DPStrategy)
    assert isinstance(trainer.strategy.collective, SingleDeviceCollective)
    assert dp_model.losses[-1] < dp_model.losses[0] / 4
    torch.testing.assert_close(flat_weights(dp_model), flat_weights(single))
    assert "val_loss" in trainer.callback_metrics


def test_dp_wraps_in_data_parallel(tmp_path: Path) -> None:
    strategy = DPStrategy()
    wrapped = strategy.setup_module(LinearModel())
    assert isinstance(wrapped, nn.DataParallel)
    assert isinstance(strategy.unwrap(wrapped), LinearModel)


def test_dp_refuses_several_nodes() -> None:
    with pytest.raises(ConfigurationError, match="one machine"):
        accord.Trainer(strategy="dp", accelerator="cpu", num_nodes=2)
