"""Debug mode turns a desynchronised fit into a named error, and the collective profiler
counts what a fit communicates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accord
from accord.collectives import TorchCollective
from accord.core.wrappers.debug import DebugCollective
from accord.core.wrappers.stats import InstrumentedCollective
from accord.errors import CollectiveMismatchError
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader


class LogsMoreOnRankOne(LinearModel):
    """Rank 1 logs an extra synced metric: the step's sync vectors differ in shape."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            self.log("extra", 1.0, sync_dist=True)
        return super().training_step(batch, batch_idx)


def _desync(rank: int, world_size: int, use_env: bool) -> str:
    if use_env:
        import os

        os.environ["ACCORD_DEBUG_COLLECTIVES"] = "1"
    strategy = DDPStrategy(debug=not use_env)
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert isinstance(strategy.collective, DebugCollective)
    assert isinstance(strategy.base_collective, TorchCollective)
    try:
        trainer.fit(LogsMoreOnRankOne(), loader(16))
    except CollectiveMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_env", [False, True], ids=["argument", "environment"])
def test_debug_mode_names_the_mismatch_on_every_rank(use_env: bool) -> None:
    messages = run_distributed(_desync, 2, use_env, timeout=90)
    for message in messages:
        assert "all_gather" in message
        assert "shape=(1, 1)" in message and "shape=(1, 2)" in message  # each rank's vector


def _profiled(rank: int, world_size: int) -> dict[str, Any]:
    trainer = accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        profiler="collectives",
    )
    trainer.fit(LinearModel(), loader(16))
    assert isinstance(trainer.strategy.collective, InstrumentedCollective)
    return {"stats": trainer.collective_stats_by_rank, "steps": trainer.global_step}


@pytest.mark.timeout(120)
def test_profiler_counts_every_collective_per_rank() -> None:
    results = run_distributed(_profiled, 2, timeout=90)
    for result in results:
        assert len(result["stats"]) == 2
        for summary in result["stats"]:
            # One all_gather per step for the synced step metric, one at the epoch end,
            # one barrier-free fit otherwise.
            assert summary["all_gather"]["calls"] == result["steps"] + 1
