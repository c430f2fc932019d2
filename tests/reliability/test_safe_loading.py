"""Loading a checkpoint runs no code from it: crafted files are refused by name.

Each crafted file holds a pickle whose loading would create a marker file; the test loads
it through the public API (`Trainer.fit(..., ckpt_path=...)`), as a user resuming a run
would, and checks that nothing was created and the error names the refused object.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accord
from accord.errors import CheckpointError
from accord.strategies import FSDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader


class _CreatesAFile:
    """Unpickling this calls ``os.system`` to create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _trainer(**kwargs: Any) -> accord.Trainer:
    return accord.Trainer(
        strategy=FSDPStrategy(state_dict_type="sharded"),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        limit_train_batches=2,
        limit_val_batches=1,
        **kwargs,
    )


def _save_then_resume(rank: int, world_size: int, root: Path) -> str:
    dist.init_process_group("gloo")
    try:
        saver = accord.callbacks.ModelCheckpoint(dirpath=root / "saved", save_last=True)
        _trainer(max_epochs=1, callbacks=[saver]).fit(
            LinearModel(), loader(batch_size=16), loader(batch_size=16)
        )
        crafted = root / "crafted.ckpt"
        shutil.copytree(root / "saved" / "last.ckpt", crafted)
        (crafted / ".metadata").write_bytes(pickle.dumps(_CreatesAFile(root / "marker")))
        try:
            _trainer(max_epochs=2).fit(LinearModel(), loader(batch_size=16), ckpt_path=crafted)
        except CheckpointError as err:
            return str(err)
        return "no error"
    finally:
        dist.destroy_process_group()


def test_a_crafted_sharded_checkpoint_runs_nothing(tmp_path: Path) -> None:
    (message,) = run_distributed(_save_then_resume, 1, tmp_path, timeout=120)
    assert not (tmp_path / "marker").exists()
    system = f"{os.system.__module__}.system"  # posix.system here
    assert system in message and "weights_only=False" in message, message


def test_a_crafted_single_file_checkpoint_runs_nothing(tmp_path: Path) -> None:
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": _CreatesAFile(tmp_path / "marker")}, crafted)
    trainer = accord.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, max_epochs=1
    )
    with pytest.raises(CheckpointError) as raised:
        trainer.fit(LinearModel(), loader(batch_size=16), ckpt_path=crafted)
    assert not (tmp_path / "marker").exists()
    assert f"{os.system.__module__}.system" in str(raised.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_entry_of_a_sharded_checkpoint_runs_nothing(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    from accord.engines.torch.safe_dcp import read_whole

    plain = {"weight": torch.ones(2), "settings": {"lr": 0.5, "names": ["a", "b"]}}
    save(plain, checkpoint_id=tmp_path / "plain", no_dist=True)
    # Non-tensor entries are read once, by the weights-only unpickler, and put in place.
    loaded = read_whole(str(tmp_path / "plain"))
    assert torch.equal(loaded["weight"], torch.ones(2))
    assert loaded["settings"] == {"lr": 0.5, "names": ["a", "b"]}

    crafted = {"weight": torch.ones(2), "extra": _CreatesAFile(tmp_path / "marker")}
    save(crafted, checkpoint_id=tmp_path / "crafted", no_dist=True)
    # DCP wraps what the read raised in its own CheckpointException (a BaseException):
    # accord's own error comes out, for `except CheckpointError` to catch.
    with pytest.raises(CheckpointError) as raised:
        read_whole(str(tmp_path / "crafted"))
    assert not (tmp_path / "marker").exists()
    assert f"{os.system.__module__}.system" in str(raised.value)
