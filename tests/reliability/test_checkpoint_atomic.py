"""A checkpoint write killed half-way leaves the previous checkpoint intact, and the next
save removes what it left."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.checkpoint import load_checkpoint_file, save_checkpoint_file
from accord.errors import CheckpointError
from accord.strategies import FSDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader
from tests.helpers.processes import ROOT, run_python

WRITER = """
import sys, torch
from accord.checkpoint import save_checkpoint_file
path = sys.argv[1]
save_checkpoint_file({"version": 0, "weights": torch.zeros(4)}, path)
print("ready", flush=True)
version = 1
while True:  # large writes, so the kill lands inside one
    save_checkpoint_file({"version": version, "weights": torch.randn(8_000_000)}, path)
    version += 1
"""


@pytest.mark.timeout(60)
def test_killing_the_writer_keeps_a_whole_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    # Wait until a big write is under way (a temporary file exists), then kill.
    deadline = time.monotonic() + 20
    while not list(tmp_path.glob(".last.ckpt.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    checkpoint = load_checkpoint_file(path)
    assert isinstance(checkpoint["version"], int)
    assert checkpoint["weights"].numel() in (4, 8_000_000)


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    save_checkpoint_file({"ok": torch.ones(1)}, path)
    with pytest.raises(Exception, match=r"pickle|lambda|Can't"):
        save_checkpoint_file({"bad": lambda: None}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]
    assert torch.equal(load_checkpoint_file(path)["ok"], torch.ones(1))


# ----------------------------------------------------------- ModelCheckpoint's saves

BIG_FIT = Path(__file__).parent / "scripts" / "big_fit.py"


def _finished(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.ckpt") if not p.name.startswith("."))


def _staged(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(".*") if p.name.endswith(".tmp"))


def _wait_for(found: Callable[[], list[Path]], process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 180
    while not found():
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def _wait_until_gone(pid: int, timeout: float = 60) -> None:
    """Wait for a rank the test did not start (rank 1, a child of the killed rank 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state == "Z":
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removesuffix(".ckpt").rpartition("step=")[2])


def _kill_rank_zero_in_the_second_save(root: Path, strategy: str) -> None:
    """Run big_fit.py; SIGKILL rank 0 once its second save has started writing."""
    checkpoints = root / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    with (root / "first.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(BIG_FIT), str(root), strategy],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        try:
            _wait_for(lambda: _finished(checkpoints), process, "the first checkpoint")
            # The next save is under way once its staging file or directory appears.
            _wait_for(lambda: _staged(checkpoints), process, "the second save")
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait()
            if (root / "rank1.json").exists():
                _wait_until_gone(json.loads((root / "rank1.json").read_text())["pid"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2"])
def test_killing_rank_zero_mid_save_keeps_the_previous_checkpoint(
    strategy: str, tmp_path: Path
) -> None:
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'accord[deepspeed]')")
    for attempt in range(3):
        root = tmp_path / f"attempt{attempt}"
        root.mkdir()
        _kill_rank_zero_in_the_second_save(root, strategy)
        checkpoints = root / "checkpoints"
        left = sorted(p.name for p in checkpoints.iterdir())
        survivors = _finished(checkpoints)
        assert survivors, f"nothing loadable left after the kill: {left}"
        assert not (root / "rank0.end.json").exists()
        if _staged(checkpoints):
            break
        # A busy machine let the save finish before the signal landed: try again.
    else:
        pytest.fail(f"the kill never landed inside a save: {left}")

    # A new run resumes from the newest finished checkpoint and completes the fit.
    run_python([str(BIG_FIT), str(root), strategy, "last"], timeout=300)
    started = json.loads((root / "rank0.json").read_text())["start_step"]
    assert started == _step_of(survivors[-1]) > 0
    ended = [json.loads((root / f"rank{r}.end.json").read_text()) for r in (0, 1)]
    assert [e["end_step"] for e in ended] == [16, 16]
    # The killed save's leftovers and the checkpoint resumed from are gone; nothing else is.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=3-step=16.ckpt"]


class FailsToSaveAtEpoch(LinearModel):
    """Its checkpoint at ``epoch`` cannot be written: it holds an object torch.save refuses."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.failing_epoch = epoch

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.current_epoch == self.failing_epoch:
            checkpoint["unpicklable"] = lambda: None


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    return accord.Trainer(
        accelerator="cpu",
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        **kwargs,
    )


def test_a_failed_save_keeps_the_checkpoint_it_would_replace(tmp_path: Path) -> None:
    callback = accord.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    with pytest.raises(CheckpointError, match=r"pickle|lambda|Can't") as raised:
        _trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(
            FailsToSaveAtEpoch(1), loader(batch_size=64)
        )
    message = str(raised.value)
    assert f"at {str(tmp_path / 'ckpt' / 'epoch=1-step=8.ckpt')!r}" in message
    # The last checkpoint saved is named as still there.
    assert f"checkpoint {str(tmp_path / 'ckpt' / 'last.ckpt')!r} is still there" in message
    # The epoch-0 checkpoint (and last.ckpt) survive, and the bookkeeping still names them.
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert list(callback.best_k_models) == [str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")]
    assert callback.best_model_path.endswith("epoch=0-step=4.ckpt")
    again = accord.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt")
    resumed = _trainer(tmp_path, max_epochs=2, callbacks=[again])
    resumed.fit(LinearModel(), loader(batch_size=64), ckpt_path="last")
    assert resumed.global_step == 8


def test_the_next_save_removes_what_killed_saves_left(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    # Staged by save_checkpoint_file (a file) and by a sharded save (a directory) that were killed.
    (directory / ".epoch=0-step=4.ckpt.k2j_9x.tmp").write_bytes(b"half a checkpoint")
    (directory / ".last.ckpt.tmp").mkdir()
    (directory / ".last.ckpt.tmp" / "__0_0.distcp").write_bytes(b"a shard")
    # Moved aside while replacing a checkpoint that is back in place, and one that is not.
    (directory / "kept.ckpt").write_bytes(b"a finished checkpoint")
    (directory / ".kept.ckpt.old").write_bytes(b"the one it replaced")
    (directory / ".only.ckpt.old").write_bytes(b"the only copy of only.ckpt")
    (directory / "notes.tmp").write_text("not a checkpoint's")
    callback = accord.callbacks.ModelCheckpoint(dirpath=directory)
    _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(LinearModel(), loader(64))
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".only.ckpt.old", "epoch=0-step=4.ckpt", "kept.ckpt", "notes.tmp"]


def test_last_never_picks_an_unfinished_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    _trainer(tmp_path, max_epochs=1).fit(LinearModel(), loader(batch_size=64))
    assert [p.name for p in directory.iterdir()] == ["epoch=0-step=4.ckpt"]
    # Newer, but unfinished: a directory its writer never completed, and staged saves.
    unfinished = directory / "epoch=7-step=99.ckpt"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"a shard")
    (directory / ".epoch=1-step=8.ckpt.tmp").mkdir()
    (directory / ".epoch=1-step=8.ckpt.abc.tmp").write_bytes(b"half")
    later = time.time() + 60
    for path in directory.iterdir():
        if path.name != "epoch=0-step=4.ckpt":
            os.utime(path, (later, later))
    resumed = _trainer(tmp_path, max_epochs=2)
    resumed.fit(LinearModel(), loader(batch_size=64), ckpt_path="last")
    assert resumed.global_step == 8


def test_a_directory_checkpoint_leaves_its_name_before_it_is_deleted(tmp_path: Path) -> None:
    from accord.checkpoint import remove_checkpoint_path

    directory = tmp_path / "ckpt"
    doomed = directory / "epoch=0-step=4.ckpt"
    (doomed / "checkpoint-0").mkdir(parents=True)
    (doomed / "latest").write_text("checkpoint-0")
    # What a delete killed halfway leaves: the rest under a hidden name, not under its own.
    (directory / ".epoch=1-step=8.ckpt.removing.tmp" / "checkpoint-0").mkdir(parents=True)
    remove_checkpoint_path(doomed)
    assert sorted(p.name for p in directory.iterdir()) == [".epoch=1-step=8.ckpt.removing.tmp"]
    remove_checkpoint_path(directory / "no-such.ckpt")  # nothing there: nothing to do
    callback = accord.callbacks.ModelCheckpoint(dirpath=directory)
    _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(LinearModel(), loader(64))
    assert sorted(p.name for p in directory.iterdir()) == ["epoch=0-step=4.ckpt"]


# ------------------------------------------------- a save that cannot be written at all


def _blocked(root: Path) -> Path:
    """A checkpoint directory that cannot be made: its parent is a regular file (a
    read-only directory would not stop root)."""
    blocker = root / "a-file"
    blocker.write_text("not a directory")
    return blocker / "checkpoints"


def _fit_into(root: Path, strategy: Any, devices: int) -> dict[str, Any]:
    """Fit one epoch saving into ``root``'s blocked directory; what this rank raised."""
    callback = accord.callbacks.ModelCheckpoint(dirpath=root / "a-file" / "checkpoints")
    trainer = _trainer(root, strategy=strategy, devices=devices, max_epochs=1, callbacks=[callback])
    try:
        trainer.fit(LinearModel(), loader(batch_size=64 // devices))
    except CheckpointError as err:
        cause = err.__cause__
        return {"message": str(err), "cause": None if cause is None else type(cause)}
    return {"message": None, "cause": None}


def test_a_save_that_cannot_be_written_raises_checkpoint_error(tmp_path: Path) -> None:
    directory = _blocked(tmp_path)
    raised = _fit_into(tmp_path, "single_device", 1)
    assert raised["message"] is not None, "the fit ended without an error"
    path = str(directory / "epoch=0-step=4.ckpt")
    assert raised["message"].startswith(f"Could not save the checkpoint at {path!r} (")
    assert "Not a directory" in raised["message"]
    assert "can be created and written" in raised["message"]
    assert raised["cause"] is not None and issubclass(raised["cause"], OSError)


def _fit_two_ranks(rank: int, world_size: int, root: Path, name: str) -> dict[str, Any]:
    strategy: Any = name
    if name == "fsdp":
        strategy = FSDPStrategy(state_dict_type="sharded")
    return _fit_into(root, strategy, world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_a_failed_save_on_rank_zero_raises_on_every_rank(tmp_path: Path, name: str) -> None:
    directory = _blocked(tmp_path)
    ranks = run_distributed(_fit_two_ranks, 2, tmp_path, name, timeout=180)
    path = str(directory / "epoch=0-step=4.ckpt")
    for rank, raised in enumerate(ranks):
        assert raised["message"] is not None, f"rank {rank} ended without an error"
        assert raised["message"].startswith(f"Could not save the checkpoint at {path!r} (")
        assert "on rank 0: " in raised["message"]
        assert "on rank 1: " not in raised["message"]
        assert "Not a directory" in raised["message"]
    assert ranks[0]["message"] == ranks[1]["message"]
    # Rank 0 chains what it raised; rank 1 had nothing to chain.
    assert ranks[0]["cause"] is not None and issubclass(ranks[0]["cause"], OSError)
    assert ranks[1]["cause"] is None
