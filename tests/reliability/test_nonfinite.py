"""A NaN loss on one rank is known to every rank in the same step, and all act alike."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import accord
from accord.collectives import TorchCollective
from accord.errors import ConfigurationError, NonFiniteValueError
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from accord.trainer.step_decision import carried_decision, decide_step
from tests.helpers.models import CountingCollective, LinearModel, flat_weights, loader
from tests.helpers.processes import run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "preempt_fit.py")
NAN_STEP = 5


def _script(root: Path, *args: str, check: bool = True) -> Any:
    return run_python([SCRIPT, str(root), *args], timeout=240, check=check)


@pytest.mark.timeout(300)
def test_ddp_nan_on_rank_one_raises_on_every_rank(tmp_path: Path) -> None:
    result = _script(tmp_path, "ddp", "nan", "1", str(NAN_STEP), "raise", check=False)
    assert result.returncode != 0
    stops = [json.loads((tmp_path / f"stop.rank{r}.json").read_text()) for r in range(2)]
    for stop in stops:
        assert stop["type"] == "NonFiniteValueError", stops
        assert stop["ranks"] == [1]
        assert stop["error_step"] == NAN_STEP
        assert stop["metric"] == "loss"
        assert "rank 1 at step 5" in stop["message"]
    assert "NonFiniteValueError" in result.stderr


@pytest.mark.timeout(300)
def test_ddp_nan_on_rank_one_skips_that_step_on_every_rank(tmp_path: Path) -> None:
    _script(tmp_path, "ddp", "nan", "1", str(NAN_STEP), "skip_step")
    finals = [torch.load(tmp_path / f"final.rank{r}.pt") for r in range(2)]
    weights = [f["weights"] for f in finals]
    assert all(torch.isfinite(w).all() for w in weights)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    # The skipped step still counts, as a step whose training_step returned None does.
    assert [f["global_step"] for f in finals] == [24, 24]


class _NaNAt(LinearModel):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if self.trainer.global_step == self.nan_step else loss


def _fit(mode: str, model: LinearModel, limit: int = 6) -> accord.Trainer:
    trainer = accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=limit,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        on_nonfinite=mode,
    )
    trainer.fit(model, loader(batch_size=16))
    return trainer


def test_single_process_raise_names_rank_step_and_metric() -> None:
    with pytest.raises(NonFiniteValueError, match="rank 0 at step 2") as info:
        _fit("raise", _NaNAt(2))
    assert (info.value.ranks, info.value.step, info.value.metric) == ([0], 2, "loss")


def test_single_process_skip_step_keeps_the_weights_of_the_step_before() -> None:
    # Skipping step 2 leaves the weights as two clean steps left them.
    reference = LinearModel()
    _fit("raise", reference, limit=2)
    skipped = _NaNAt(2)
    with pytest.warns(RuntimeWarning, match="skipped on every rank"):
        _fit("skip_step", skipped, limit=3)
    torch.testing.assert_close(flat_weights(skipped), flat_weights(reference), rtol=0, atol=0)


def test_single_process_warn_trains_on() -> None:
    model = _NaNAt(1)
    with pytest.warns(RuntimeWarning, match="trained on"):
        trainer = _fit("warn", model, limit=3)
    assert trainer.global_step == 3
    assert not torch.isfinite(flat_weights(model)).all()


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"on_nonfinite=.skip. is not known; use one of raise, skip_step, warn",
    ):
        accord.Trainer(accelerator="cpu", on_nonfinite="skip")


class _Quiet(accord.Module):
    """A linear model that logs nothing, so the loop's own collectives are all there is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _count_collectives(rank: int, world_size: int, accumulate: int) -> dict[str, int]:
    strategy = DDPStrategy(collective=CountingCollective())
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(_Quiet(), loader(batch_size=16))
    collective = strategy.collective
    assert isinstance(collective, CountingCollective)
    return {**collective.calls, "steps": trainer.global_step}


@pytest.mark.timeout(180)
def test_skip_nonfinite_and_preemption_share_one_all_reduce_per_batch() -> None:
    """With an accumulation window the ranks agree before backward: one all_reduce per
    batch. With one batch per step DDP's gradient reduction carries the answers: no
    collective of their own."""
    for accumulate, expected in ((2, {"all_reduce": 8, "steps": 4}), (1, {"steps": 8})):
        for result in run_distributed(_count_collectives, 2, accumulate, timeout=150):
            assert result == expected


def _decide_at_twelve_ranks(rank: int, world_size: int) -> list[tuple[Any, ...]]:
    collective = TorchCollective("gloo").setup()
    strategy = SimpleNamespace(
        world_size=world_size,
        global_rank=rank,
        root_device=torch.device("cpu"),
        collective=collective,
    )
    loss = None if rank == 5 else torch.tensor(math.nan if rank in (3, 11) else 1.0)
    decisions = [
        decide_step(strategy, loss, check_loss=True, signalled=rank == 10),  # type: ignore[arg-type]
        carried_decision([4 * (r == 10) + 2 * (r in (3, 11)) + (r == 5) for r in range(12)]),
        decide_step(strategy, torch.tensor(0.0), check_loss=True, signalled=False),  # type: ignore[arg-type]
    ]
    collective.teardown()
    return [(d.skip, d.nonfinite_ranks, d.preempt_ranks) for d in decisions]


@pytest.mark.timeout(240)
def test_the_decision_names_every_rank_beyond_ten() -> None:
    """Seven ranks share a word of the decision: ranks 3 and 11 (different words) report a
    NaN, rank 5 skips and rank 10 was signalled, and all twelve ranks read the same."""
    results = run_distributed(_decide_at_twelve_ranks, 12, timeout=200)
    expected = [(True, (3, 11), (10,))] * 2 + [(False, (), ())]
    assert results == [expected] * 12
