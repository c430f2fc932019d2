"""Under ``ddp_spawn`` everything passed to the ranks is pickled; what cannot be pickled is
a `ConfigurationError` that says what and how to avoid it, not a raw pickling error."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

import accord
from accord.errors import ConfigurationError
from tests.helpers.models import LinearModel, regression_data


@pytest.mark.timeout(60)
def test_spawn_with_a_lambda_collate_fn_explains_what_to_do() -> None:
    trainer = accord.Trainer(
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    loader = DataLoader(regression_data(32), batch_size=8, collate_fn=lambda batch: batch)
    with pytest.raises(ConfigurationError) as info:
        trainer.fit(LinearModel(), loader)
    message = str(info.value)
    assert "<lambda>" in message  # the pickling error's own words: what failed
    assert "collate_fn" in message  # where it sits
    assert "strategy='ddp'" in message
    assert "ddp_fork" in message
    assert "module level" in message
    assert info.value.__cause__ is not None
