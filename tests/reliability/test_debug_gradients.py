"""Debug mode sees DDP's gradient traffic: a rank whose user collectives run out of step with
the gradient sync gets a `CollectiveMismatchError` on every rank, not a backend crash."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accord
from accord.callbacks import Callback
from accord.core.wrappers.debug import DebugCollective
from accord.errors import CollectiveMismatchError
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader

SKIP_AT = 2


def _two_rank_trainer(strategy: DDPStrategy, **kwargs: Any) -> accord.Trainer:
    """A one-epoch fit on 2 CPU ranks with ``strategy``, nothing written."""
    return accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )


class SkipsBarrierOnRankOne(LinearModel):
    """Right before backward at batch `SKIP_AT`, rank 0 waits at a barrier that rank 1
    skips: rank 1's next collective is DDP's first gradient bucket."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_idx = batch_idx
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.batch_idx == SKIP_AT:
            self.diverged_at = time.monotonic()
            if self.global_rank == 0:
                self.trainer.strategy.barrier()


def _fit(rank: int, world_size: int) -> dict[str, Any]:
    strategy = DDPStrategy(debug=True)
    trainer = _two_rank_trainer(strategy)
    model = SkipsBarrierOnRankOne()
    try:
        trainer.fit(model, loader(16))
    except CollectiveMismatchError as err:
        return {
            "error": str(err),
            "seconds": time.monotonic() - model.diverged_at,
            "debug": isinstance(strategy.collective, DebugCollective),
        }
    return {"error": None}


@pytest.mark.timeout(180)
def test_skipped_barrier_meets_a_gradient_bucket_and_every_rank_names_both(
    tmp_path: Path,
) -> None:
    # The ranks' call records, which a mismatch leaves, go to the test's directory.
    results = run_distributed(_fit, 2, timeout=150, env={"ACCORD_TRACE_DIR": str(tmp_path)})
    for rank, result in enumerate(results):
        message = result["error"]
        assert message is not None, f"rank {rank} finished the fit without an error"
        assert result["debug"]
        # Both calls are named: rank 0's barrier and rank 1's gradient bucket, with where
        # each came from.
        assert "rank 0: barrier(" in message
        assert "rank 1: all_reduce(" in message and "op=mean" in message
        assert "_ddp_gradient_bucket_hook" in message
        assert "test_debug_gradients.py" in message  # rank 0's barrier line
        # From the divergence to the error on this rank: two tiny collectives.
        assert result["seconds"] < 5


def _fit_debug_and_plain(rank: int, world_size: int) -> list[torch.Tensor]:
    weights = []
    for debug in (False, True):
        strategy = DDPStrategy(debug=debug)
        trainer = _two_rank_trainer(strategy)
        model = LinearModel()
        trainer.fit(model, loader(16))
        if debug:
            checked = strategy.collective
            assert isinstance(checked, DebugCollective)
            # Every step sent at least one gradient bucket through the checked collective.
            assert checked.calls_checked >= trainer.global_step
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return weights


@pytest.mark.timeout(180)
def test_debug_mode_trains_to_the_same_weights_as_native_sync() -> None:
    results = run_distributed(_fit_debug_and_plain, 2, timeout=150)
    for plain, debugged in results:
        torch.testing.assert_close(debugged, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


class CountsCheckedCalls(Callback):
    """The debug check's call count at the end of every training batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        checked = trainer.strategy.collective
        assert isinstance(checked, DebugCollective)
        self.counts.append(checked.calls_checked)


def _checked_calls_per_batch(rank: int, world_size: int) -> list[int]:
    counter = CountsCheckedCalls()
    trainer = _two_rank_trainer(DDPStrategy(debug=True), callbacks=[counter])
    trainer.fit(LinearModel(), loader(16))
    return [b - a for a, b in zip(counter.counts, counter.counts[1:], strict=False)]


@pytest.mark.timeout(180)
def test_debug_mode_checks_no_collective_of_its_own_for_the_step_decision() -> None:
    """Per batch, two checked collectives: the model's gradients (one bucket, which
    carries the per-batch decision, checked with it) and the sync of its logged loss. The
    decision is not a checked collective of its own."""
    for per_batch in run_distributed(_checked_calls_per_batch, 2, timeout=150):
        assert per_batch and set(per_batch) == {2}, per_batch
