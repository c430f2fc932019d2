"""A ``training_step`` that returns None skips the step: on several ranks, all of them skip it
together (one rank alone would wait for the others' gradients forever), and a step that
forgets ``return`` on every batch warns instead of training nothing in silence."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import accord
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, flat_weights, loader

SKIPPED_BATCH = 2


class SkipsOnOneRank(LinearModel):
    """Returns None at batch 2 of each epoch on ``rank`` only, after logging like the others
    did (rank 0) or before logging anything (rank 1)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.skip_rank = rank
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if batch_idx == SKIPPED_BATCH and self.global_rank == self.skip_rank == 1:
            return None
        loss = super().training_step(batch, batch_idx)
        self.log("rank_metric", float(self.global_rank), sync_dist=True, on_epoch=True)
        if batch_idx == SKIPPED_BATCH and self.global_rank == self.skip_rank == 0:
            return None
        self.steps_run += 1
        return loss


class SkipsEverywhere(LinearModel):
    """Returns None at batch 2 of each epoch: the single-device reference."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == SKIPPED_BATCH else loss


def _trainer(strategy: str | DDPStrategy, devices: int, **kwargs: Any) -> accord.Trainer:
    return accord.Trainer(
        strategy=strategy,
        devices=devices,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )


def _skip_on_one_rank(rank: int, world_size: int, accumulate: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for strategy in ("ddp", "ddp_find_unused_parameters_true", "ddp debug"):
        for skip_rank in (0, 1):
            model = SkipsOnOneRank(skip_rank)
            # Debug mode checks every gradient bucket, which then carries the decision.
            chosen = DDPStrategy(debug=True) if strategy == "ddp debug" else strategy
            trainer = _trainer(chosen, world_size, accumulate_grad_batches=accumulate)
            trainer.fit(model, loader(16))
            results[f"{strategy}-{skip_rank}"] = {
                "weights": flat_weights(model),
                "steps": trainer.global_step,
                "rank_metric": float(trainer.callback_metrics["rank_metric"]),
            }
    return results


# With one batch per step, plain DDP runs backward while the ranks agree on the batch (the
# rank that skipped joins with zero gradients, then every rank drops them); with two, or
# with find_unused_parameters, the ranks agree first.
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_one_rank_skips_is_skipped_by_every_rank(accumulate: int) -> None:
    reference = SkipsEverywhere()
    _trainer("single_device", 1, accumulate_grad_batches=accumulate).fit(reference, loader(32))
    results = run_distributed(_skip_on_one_rank, 2, accumulate, timeout=240)
    for key, first in results[0].items():
        second = results[1][key]
        torch.testing.assert_close(first["weights"], second["weights"], rtol=0, atol=0)
        assert first["steps"] == second["steps"] == 2 * 8 // accumulate
        # The skipped step's logged values were dropped on every rank alike.
        assert first["rank_metric"] == second["rank_metric"] == 0.5
        # Skipping the global batch on both ranks is skipping it on one device.
        torch.testing.assert_close(
            first["weights"], flat_weights(reference), rtol=1e-5, atol=1e-6, msg=key
        )


class ForgetsReturn(LinearModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        super().training_step(batch, batch_idx)


def test_a_step_that_never_returns_a_loss_warns_once() -> None:
    model = ForgetsReturn()
    before = flat_weights(model)
    with pytest.warns(UserWarning, match="returned None for every batch") as caught:
        _trainer("single_device", 1).fit(model, loader(32))
    assert len([w for w in caught if "returned None" in str(w.message)]) == 1
    torch.testing.assert_close(flat_weights(model), before, rtol=0, atol=0)


def test_skipping_some_batches_on_one_device_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "SkipsEverywhere defines validation_step")
        _trainer("single_device", 1).fit(SkipsEverywhere(), loader(32))
