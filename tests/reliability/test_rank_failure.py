"""When one rank raises or is killed mid-fit, every rank and the launcher end quickly,
with a non-zero status and a message naming the failed rank; no process is left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import accord
from accord.errors import CollectiveTimeoutError, RankFailureError, is_communication_error
from accord.testing import run_distributed
from tests.helpers.models import FailingModel, LostPeerModel, loader
from tests.helpers.processes import ROOT

SCRIPT = str(ROOT / "tests" / "strategies" / "scripts" / "fit.py")


def _ddp_script(model: str, before: str = "", after: str = "") -> str:
    """A two-rank ddp script (one epoch on the CPU) that fits ``model``, a `tests.helpers.models` class
    called with its arguments, with ``before`` and ``after`` the fit."""
    return f"""
import atexit
import os
import sys
import time

sys.path.insert(0, {str(ROOT)!r})

from tests.helpers.models import {model.partition("(")[0]}, loader

import accord

{before}
trainer = accord.Trainer(
    strategy="ddp",
    devices=2,
    accelerator="cpu",
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
trainer.fit({model}, loader(16))
{after}
"""


# Rank 0 is still tearing down (for longer than the launcher's watcher takes to notice)
# when its peer is SIGKILLed.
SLOW_TEARDOWN_SCRIPT = _ddp_script('SlowTeardownModel(1, "kill", seconds=1.0)')

# Local rank 1 finishes its work and then dies as it exits, late enough that rank 0 is
# exiting too: the launcher's last word must report it.
ABORT_AT_EXIT_SCRIPT = _ddp_script(
    "LinearModel()",
    before='if os.environ.get("LOCAL_RANK") == "1":\n'
    "    atexit.register(lambda: (time.sleep(2), os.abort()))",
    after='if trainer.global_rank == 0:\n    print("rank 0 finished")',
)


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
    return _run_python(SCRIPT, str(out), "ddp", "2", "1", *extra, timeout=timeout)


def _last_line(stderr: str) -> str:
    """The last line of ``stderr``, without the ``[rank0]: `` torch.distributed puts before it."""
    return re.sub(r"^\[rank\d+\]: ", "", stderr.strip().splitlines()[-1])


def _run_python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, *args],
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
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # Not through pipes: the children hold them open, and the wait would be for them too.
    rank_zero = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path), "ddp", "2", "1", "0", "kill"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert rank_zero.wait(timeout=60) == -9
    # Rank 1 finds the store rank 0 served gone at once (a refused connection), not after
    # torch's store client has retried for 20 s.
    deadline = time.monotonic() + 10
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
    message = str(info.value)
    # Rank 0 may fail too, having lost its peer; it is listed as a consequence, not the cause.
    assert message.startswith("Local rank 1 failed")
    if how == "raise":
        assert "rank 1 fails on purpose" in message
    else:
        assert "exit code -9" in message
    # Far below a hang (the collective timeout is 30 min), with room for a busy machine:
    # two torch imports and a fit on two shared cores took 55 s once.
    assert time.monotonic() - started < 60


def _spawn_trainer() -> accord.Trainer:
    return accord.Trainer(
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


@pytest.mark.timeout(90)
def test_spawn_names_the_killed_rank_even_when_its_peer_reports_first() -> None:
    # Rank 0 reports "Connection reset by peer" a second before rank 1 is killed: the
    # killed rank is the cause, rank 0's error a consequence.
    with pytest.raises(RankFailureError) as info:
        _spawn_trainer().fit(LostPeerModel(1, delay=1.0), loader(16))
    message = str(info.value)
    assert message.startswith("Local rank 1 failed")
    assert "exit code -9" in message
    cause, _, consequences = message.partition("Consequences")
    assert "Connection reset by peer" not in cause
    assert "local rank 0" in consequences
    assert "Connection reset by peer" in consequences


@pytest.mark.timeout(120)
def test_popen_interrupt_during_rank_zero_cleanup_still_names_the_killed_rank(
    tmp_path: Path,
) -> None:
    # The watcher interrupts rank 0 while its teardown runs: the interrupt must become a
    # RankFailureError naming rank 1, not a bare KeyboardInterrupt.
    script = tmp_path / "slow_teardown.py"
    script.write_text(SLOW_TEARDOWN_SCRIPT)
    result = _run_python(str(script), timeout=90)
    last_line = _last_line(result.stderr)
    assert result.returncode == 1, result.stderr
    assert last_line.startswith("accord.errors.RankFailureError: Local rank 1 failed"), last_line
    assert "signal 9" in last_line
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(90)
def test_popen_rank_zero_bug_is_reported_as_itself(tmp_path: Path) -> None:
    result = _run_script(tmp_path, "0", "raise")
    last_line = _last_line(result.stderr)
    assert result.returncode == 1, result.stderr
    assert last_line == "RuntimeError: rank 0 fails on purpose", result.stderr
    # Rank 0 stopped rank 1 itself: that is no failure to report or interrupt rank 0 for.
    assert "KeyboardInterrupt" not in result.stderr
    assert "local rank 1 was killed" not in result.stderr
    assert _processes_mentioning(str(tmp_path)) == []


def _lose_the_peer(rank: int, world_size: int) -> bool | None:
    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()  # closes rank 0's connections mid-call
        return None
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as err:
        return is_communication_error(err)
    return False


@pytest.mark.timeout(90)
def test_a_vanished_peer_is_a_communication_error() -> None:
    assert run_distributed(_lose_the_peer, 2, timeout=60) == [True, None]


def test_which_errors_are_communication_errors() -> None:
    assert is_communication_error(CollectiveTimeoutError("rank 0 waited 2 s"))
    assert is_communication_error(dist.DistNetworkError("failed to recv"))
    assert is_communication_error("RuntimeError: pair.cc:534] Connection closed by peer [::1]")
    assert is_communication_error(
        RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    )
    assert not is_communication_error(ValueError("rank 1 cannot read its shard"))
    assert not is_communication_error(KeyboardInterrupt())
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as err:
            raise ValueError("while logging the loss") from err
    except ValueError as err:
        assert is_communication_error(err)


@pytest.mark.timeout(90)
def test_popen_child_that_dies_as_it_exits_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "abort_at_exit.py"
    script.write_text(ABORT_AT_EXIT_SCRIPT)
    result = _run_python(str(script))
    assert "rank 0 finished" in result.stdout, result.stderr
    assert "local rank 1 was killed by signal 6" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert _processes_mentioning(str(tmp_path)) == []
