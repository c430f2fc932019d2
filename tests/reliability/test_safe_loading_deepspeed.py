"""Loading a DeepSpeed checkpoint runs no code from it: crafted files are refused by name.

A real ``deepspeed_stage_2`` checkpoint of two ranks is copied, and one file of the copy
replaced by a pickle whose loading would create a marker file: the model states that
every rank reads, or the optimizer states that only rank 1 reads (so both ranks must
refuse together, before DeepSpeed's collective load). Resuming (`fit`) and evaluating
(`validate`) from the copy raise `CheckpointError` on every rank, naming the refused
global, and nothing is created.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accord
from accord.errors import CheckpointError
from accord.strategies import consolidate_deepspeed_checkpoint
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader

TIMEOUT = 240.0  # generous: the first DeepSpeed engine may build its extension
SYSTEM = f"{os.system.__module__}.system"  # posix.system here
VICTIMS = ("mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt")


class _CreatesAFile:
    """Unpickling this calls ``os.system`` to create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _trainer(**kwargs: Any) -> accord.Trainer:
    return accord.Trainer(
        strategy="deepspeed_stage_2",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        limit_train_batches=2,
        limit_val_batches=1,
        **kwargs,
    )


def _craft(saved: Path, crafted: Path, victim: str, marker: Path) -> None:
    shutil.copytree(saved, crafted)
    tag = (crafted / "latest").read_text().strip()
    assert (crafted / tag / victim).is_file(), sorted(p.name for p in (crafted / tag).iterdir())
    torch.save({"optimizer_state_dict": _CreatesAFile(marker)}, crafted / tag / victim)


def _refusals(crafted: Path) -> dict[str, str]:
    """What fit and validate from ``crafted`` raise on this rank."""
    messages = {}
    for stage in ("fit", "validate"):
        trainer = _trainer(max_epochs=2, enable_checkpointing=False)
        run = trainer.fit if stage == "fit" else trainer.validate
        try:
            run(LinearModel(), loader(batch_size=16), ckpt_path=crafted)
        except CheckpointError as err:
            messages[stage] = str(err)
        else:
            messages[stage] = "no error"
    return messages


def _save_craft_load(rank: int, world_size: int, root: Path) -> dict[str, dict[str, str]]:
    # One process group for every run, so the ranks can wait for the crafting in between.
    dist.init_process_group("gloo")
    try:
        saver = accord.callbacks.ModelCheckpoint(dirpath=root / "saved", save_last=True)
        _trainer(max_epochs=1, callbacks=[saver]).fit(
            LinearModel(), loader(batch_size=16), loader(batch_size=16)
        )
        if rank == 0:
            for victim in VICTIMS:
                _craft(root / "saved" / "last.ckpt", root / victim, victim, root / "marker")
        dist.barrier()
        return {victim: _refusals(root / victim) for victim in VICTIMS}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_crafted_deepspeed_checkpoint_runs_nothing(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ranks = run_distributed(_save_craft_load, 2, tmp_path, timeout=TIMEOUT)
    assert not (tmp_path / "marker").exists()
    for messages in ranks:
        for victim in VICTIMS:
            for stage in ("fit", "validate"):
                message = messages[victim][stage]
                assert SYSTEM in message and victim in message, (victim, stage, message)
                assert "weights_only=False" in message, message
    for victim in VICTIMS:
        with pytest.raises(CheckpointError, match=SYSTEM):
            consolidate_deepspeed_checkpoint(tmp_path / victim, tmp_path / "weights.pt")
    assert not (tmp_path / "marker").exists()
    assert not (tmp_path / "weights.pt").exists()
    # The checkpoint they were copied from loads as before.
    consolidate_deepspeed_checkpoint(tmp_path / "saved" / "last.ckpt", tmp_path / "weights.pt")
    LinearModel().load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
