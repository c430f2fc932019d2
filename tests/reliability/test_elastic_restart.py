"""Under ``torchrun --max-restarts 1`` a rank killed mid-fit costs only the steps since the
last checkpoint: torchelastic restarts the group, which rejoins the agent's store and
resumes by itself, and ends with the uninterrupted run's weights."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.environments import LocalEnvironment
from accord.strategies import DDPStrategy
from accord.trainer.recovery import restart_checkpoint
from tests.helpers.processes import ROOT, run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "preempt_fit.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TOTAL_STEPS = 24


@pytest.mark.timeout(600)
def test_torchrun_restart_after_a_rank_is_killed_resumes_to_the_same_weights(
    tmp_path: Path,
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    run_python([SCRIPT, str(full), "ddp", "full"], timeout=240)
    expected = torch.load(full / "final.rank0.pt")["weights"]

    elastic = tmp_path / "elastic"
    elastic.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    command = [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        SCRIPT,
        str(elastic),
        "ddp",
        "kill",
        "1",
        "20",
    ]
    # Before the fix the restarted group hung on the first attempt's store keys.
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[accord] restart 1: resuming from" in result.stderr
    assert "step=20.ckpt" in result.stderr or "step=15.ckpt" in result.stderr
    for rank in range(2):
        final = torch.load(elastic / f"final.rank{rank}.pt")
        assert final["global_step"] == TOTAL_STEPS
        torch.testing.assert_close(final["weights"], expected, rtol=0, atol=1e-6)


class _Restarted(LocalEnvironment):
    """A machine whose scheduler says this is the job's ``restarts``-th restart."""

    def __init__(self, restarts: int) -> None:
        super().__init__()
        self.restarts = restarts

    def restart_count(self) -> int:
        return self.restarts


def _trainer(root: Path, restarts: int, **kwargs: Any) -> accord.Trainer:
    strategy = DDPStrategy(cluster_environment=_Restarted(restarts))
    return accord.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, default_root_dir=root, **kwargs
    )


def test_a_restart_picks_the_newest_finished_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="accord")
    assert restart_checkpoint(_trainer(tmp_path, restarts=0)) is None
    assert restart_checkpoint(_trainer(tmp_path, restarts=1)) is None
    assert "restart 1: no finished checkpoint yet" in caplog.text
    caplog.clear()

    # The default ModelCheckpoint's directory: the logger's version directory.
    checkpoints = tmp_path / "logs" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "epoch=0-step=8.ckpt").write_bytes(b"older")
    newest = checkpoints / "preempted.ckpt"
    newest.write_bytes(b"newer")
    os.utime(checkpoints / "epoch=0-step=8.ckpt", (1, 1))
    (checkpoints / ".epoch=1-step=16.ckpt.tmp").write_bytes(b"unfinished")
    assert restart_checkpoint(_trainer(tmp_path, restarts=2)) == newest
    assert f"restart 2: resuming from {str(newest)!r}" in caplog.text
    assert restart_checkpoint(_trainer(tmp_path, restarts=2, auto_resume=False)) is None
