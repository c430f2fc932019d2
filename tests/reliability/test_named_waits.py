"""A rank that freezes, dies or skips a call while the others wait inside DDP's own gradient
reduction is named on every survivor, without debug mode: `RankFailureError` with the
frozen rank, or `CollectiveTimeoutError` with the rank that is elsewhere, each saying
where every rank was (the heartbeats on the rendezvous store)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import ROOT, run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "stall.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ENV = {"ACCORD_COLLECTIVE_TIMEOUT": "10"}


def _results(output: str) -> dict[int, tuple[str, str]]:
    """Each rank's ``RESULT`` line: the error's class and the ranks it names."""
    found = {}
    for rank, kind, ranks in re.findall(r"^RESULT (\d) (\w+) (\[[\d, ]*\]|None)", output, re.M):
        found[int(rank)] = (kind, ranks)
    return found


def _messages(output: str) -> dict[int, str]:
    return {int(r): m for r, m in re.findall(r"^MESSAGE (\d) (.*)$", output, re.M)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_frozen_rank_is_named_by_the_rank_waiting_on_it(tmp_path: Path, strategy: str) -> None:
    result = run_python([SCRIPT, "freeze", strategy], timeout=120, env=ENV, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    if strategy == "ddp":
        # Rank 0 runs in the launching process: its own error names the frozen rank.
        assert _results(output)[0] == ("RankFailureError", "[1]"), output
        message = _messages(output)[0]
        assert "rank 1 stopped answering" in message
        assert "rank 0: alive, last at step 2" in message
        assert "Timed out waiting" in message  # the backend's own words, quoted
    else:
        # The launching process reports the frozen rank as the cause, rank 0's error after.
        assert "Local rank 1 failed:\nits heartbeat stood still" in output, output
        assert "local rank 0: RankFailureError: Rank 0 stopped at step 2" in output


@pytest.mark.timeout(150)
def test_a_skipped_barrier_names_the_other_rank_on_both(tmp_path: Path) -> None:
    result = run_python([SCRIPT, "skip"], timeout=120, env=ENV, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    found = _results(output)
    # Rank 1 waited in DDP's gradient reduction: every rank was alive, so rank 0 was
    # elsewhere; rank 0 waited in the barrier, whose watchdog names rank 1.
    assert found[1] == ("CollectiveTimeoutError", "[0]"), output
    assert "different collective calls" in _messages(output)[1]
    assert "rank 0: alive" in _messages(output)[1]
    assert "for ranks [1]" in output


@pytest.mark.timeout(150)
def test_under_torchrun_the_skipped_barrier_is_named_on_every_rank(tmp_path: Path) -> None:
    env = {**ENV, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "skip"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**_clean_env(), **env},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    found = _results(output)
    assert found[1] == ("CollectiveTimeoutError", "[0]"), output
    assert found[0] == ("CollectiveTimeoutError", "[1]"), output


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    return {k: v for k, v in os.environ.items() if k not in drop}
