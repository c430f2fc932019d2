"""On several ranks every DataLoader is sharded: a plain ``batch_sampler`` keeps its batch size
and ``drop_last`` with the sampler inside it sharded; one accord cannot shard is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

import accord
from accord.errors import ConfigurationError
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, flat_weights, regression_data


class Recording(LinearModel):
    """Records the first feature of every sample it trains on (the samples are distinct)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []
        self.batch_sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch[0][:, 0].tolist())
        self.batch_sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


class MyBatchSampler(BatchSampler):
    """A subclass: its batching rule is the user's own, so accord must not guess."""


def _trainer() -> accord.Trainer:
    return accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


def _fit_with_batch_samplers(rank: int, world_size: int) -> dict[str, Any]:
    data = regression_data(100)
    results: dict[str, Any] = {}
    for name, inner, drop_last in (
        ("sequential", SequentialSampler(data), False),
        ("random-drop-last", RandomSampler(data), True),
    ):
        model = Recording()
        batches = DataLoader(data, batch_sampler=BatchSampler(inner, 16, drop_last))
        _trainer().fit(model, batches)
        results[name] = {"seen": model.seen, "sizes": model.batch_sizes}
    plain = Recording()
    _trainer().fit(plain, DataLoader(data, batch_size=16))
    results["plain"] = flat_weights(plain)
    # The sequential batch_sampler run must train exactly like batch_size=16.
    again = Recording()
    _trainer().fit(
        again, DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 16, False))
    )
    results["sequential-weights"] = flat_weights(again)
    custom = DataLoader(data, batch_sampler=MyBatchSampler(SequentialSampler(data), 16, False))
    try:
        _trainer().fit(Recording(), custom)
    except ConfigurationError as err:
        results["custom"] = str(err)
    return results


def test_a_plain_batch_sampler_is_sharded_and_keeps_its_settings() -> None:
    ranks = run_distributed(_fit_with_batch_samplers, 2, timeout=180)
    everything = sorted(regression_data(100).tensors[0][:, 0].tolist())
    # 100 samples over 2 ranks: 50 each; batches of 16 -> 16, 16, 16, 2 (or 3 with drop_last).
    assert [r["sequential"]["sizes"] for r in ranks] == [[16, 16, 16, 2]] * 2
    assert [r["random-drop-last"]["sizes"] for r in ranks] == [[16, 16, 16]] * 2
    seen = sorted(ranks[0]["sequential"]["seen"] + ranks[1]["sequential"]["seen"])
    assert seen == pytest.approx(everything)
    # A RandomSampler inside stays shuffled: rank 0 does not get every other sample in order.
    assert ranks[0]["random-drop-last"]["seen"] != ranks[0]["sequential"]["seen"][:48]
    for rank in ranks:
        torch.testing.assert_close(rank["sequential-weights"], rank["plain"], rtol=0, atol=0)
        assert "MyBatchSampler" in rank["custom"]
        assert "DistributedSampler" in rank["custom"]


def test_a_single_device_keeps_the_loader_as_it_is() -> None:
    data = regression_data(40)
    model = Recording()
    batches = DataLoader(data, batch_sampler=MyBatchSampler(SequentialSampler(data), 16, False))
    accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    ).fit(model, batches)
    assert model.batch_sizes == [16, 16, 8]
