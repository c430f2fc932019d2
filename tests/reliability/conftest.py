"""Fixtures shared by the reliability tests."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from accord.testing import run_distributed
from tests.helpers.resume import SAVE_STEP, MidEpochSaves, fit, save_mid_epoch, saved_path


@pytest.fixture(scope="session")
def mid_epoch_saves(tmp_path_factory: pytest.TempPathFactory) -> MidEpochSaves:
    """The resume fit (`tests.helpers.resume`) saved half-way through epoch 1 under
    single_device and, on 2 ranks, ddp, fsdp, deepspeed_stage_2 and deepspeed_stage_3 (the
    DeepSpeed ones where it is installed), and the uninterrupted ddp fit: their root, and
    the (epoch, sample) pairs each run trained on, every rank's together.

    The resume matrix resumes these checkpoints and the checkpoint command reads them;
    neither writes into the root.
    """
    root = tmp_path_factory.mktemp("mid_epoch_saves")
    names: tuple[str, ...] = ("ddp", "fsdp")
    if importlib.util.find_spec("deepspeed") is not None:
        names += ("deepspeed_stage_2", "deepspeed_stage_3")
    ranks = run_distributed(save_mid_epoch, 2, root, names, timeout=400)
    seen = {key: list(itertools.chain.from_iterable(r[key] for r in ranks)) for key in ranks[0]}
    seen["single_device"] = fit(
        "single_device", 1, saved_path(root, "single_device"), save_step=SAVE_STEP
    )
    return root, seen
