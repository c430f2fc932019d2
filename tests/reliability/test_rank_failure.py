"""When one rank raises or is killed mid-fit, every rank and the launcher end quickly,
with a non-zero status and a message naming the failed rank; no process is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from models import FailingModel, loader

import accord
from accord.errors import RankFailureError

SCRIPT = str(Path(__file__).parents[1] / "strategies" / "scripts" / "fit.py")


def _processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _run_script(out: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, SCRIPT, str(out), "ddp", "2", "1", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.timeout(90)
def test_popen_rank_that_raises_ends_the_job(tmp_path: Path) -> None:
    result = _run_script(tmp_path, "1", "raise")
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr
    assert "local rank 1" in result.stderr
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(90)
def test_popen_rank_killed_with_sigkill_ends_the_job(tmp_path: Path) -> None:
    result = _run_script(tmp_path, "1", "kill")
    assert result.returncode != 0
    assert "local rank 1" in result.stderr
    assert "signal 9" in result.stderr or "code -9" in result.stderr
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(90)
def test_popen_children_exit_when_rank_zero_is_killed(tmp_path: Path) -> None:
    result = _run_script(tmp_path, "0", "kill")
    assert result.returncode == -9
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_spawn_names_the_failed_rank(how: str) -> None:
    trainer = accord.Trainer(
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    started = time.monotonic()
    with pytest.raises(RankFailureError, match=r"Local rank 1 failed") as info:
        trainer.fit(FailingModel(1, how), loader(16))
    if how == "raise":
        assert "rank 1 fails on purpose" in str(info.value)
    else:
        assert "exit code -9" in str(info.value)
    assert time.monotonic() - started < 30
