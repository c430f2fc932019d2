"""Every benchmark script starts and reports: one tiny ``--smoke`` round, raw and accord only.

Benchmarks never run in ``make test``; this only checks that ``make bench`` would not fail
on a broken script. The scripts run side by side, so the whole file takes a few seconds
more than the slowest of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.processes import ROOT

BENCH = ROOT / "benchmarks"
SCRIPTS = {
    "import": ["bench_import.py"],
    "fit_1": ["bench_fit.py", "--ranks", "1"],
    "fit_2": ["bench_fit.py", "--ranks", "2"],
    "memory_1": ["bench_memory.py", "--ranks", "1"],
    "memory_2": ["bench_memory.py", "--ranks", "2"],
    "grad_sync": ["bench_grad_sync.py"],
    "reduce": ["bench_reduce.py"],
    "logging": ["bench_logging.py"],
    "startup": ["bench_startup.py"],
    "timeline": ["bench_timeline.py"],
    "debug": ["bench_debug.py"],
    "checkpoint": ["bench_checkpoint.py"],
    "calls": ["bench_calls.py"],
    "rank_loss": ["bench_rank_loss.py"],
}
# Scripts that measure accord against itself (a feature on vs off), not against raw PyTorch.
SELF_COMPARED = {"debug", "grad_sync", "rank_loss", "timeline"}
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "GROUP_RANK")


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Start every script with ``--smoke`` at once; yield each one's exit, output and JSON."""
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(BENCH / args[0]), *args[1:], "--smoke", "--json", out / name],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for name, args in SCRIPTS.items()
    }
    runs: dict[str, Any] = {}
    deadline = time.monotonic() + 240
    try:
        for name, proc in procs.items():
            try:
                output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                # Stuck: SIGABRT makes faulthandler print every thread's stack, in the
                # script and in the ranks it started, into the output the test shows.
                os.killpg(proc.pid, signal.SIGABRT)
                try:
                    output, _ = proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    output, _ = proc.communicate()
                output = f"still running after 240 s; the stacks at SIGABRT:\n{output}"
            path = out / name
            payload = json.loads(path.read_text()) if path.exists() else None
            runs[name] = (proc.returncode, output, payload)
        yield runs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs_and_reports(smoke_runs: dict[str, Any], name: str) -> None:
    code, output, payload = smoke_runs[name]
    assert code == 0, output
    assert payload is not None, output
    assert payload["machine"]["torch"]
    for sec in payload["sections"]:
        contestants = [row["contestant"] for row in sec["rows"]]
        assert name in SELF_COMPARED or "accord" in contestants, sec
        for row in sec["rows"]:
            assert row["n"] >= 1 and row["min"] <= row["median"] <= row["max"], row
        # Peers are left out of a smoke run, each with its reason.
        assert all(reason for reason in sec["skipped"].values()), sec
        assert f"### {sec['title']}" in output


def test_accord_syncs_ten_logged_metrics_in_one_collective(smoke_runs: dict[str, Any]) -> None:
    _, output, payload = smoke_runs["logging"]
    assert payload is not None, output
    counts = next(s for s in payload["sections"] if s["key"] == "logging_collectives")
    accord = next(row for row in counts["rows"] if row["contestant"] == "accord")
    # One all_gather carries the ten metrics; the step decision rides in DDP's gradients.
    assert accord["median"] == 1, counts


def test_the_loop_adds_at_most_25_calls_per_step(smoke_runs: dict[str, Any]) -> None:
    """Counted with sys.setprofile over 100 steps, not timed: hooks nobody defined cost
    nothing, and the loop's own bookkeeping stays small (one device and ddp x2)."""
    _, output, payload = smoke_runs["calls"]
    assert payload is not None, output
    for key in ("calls_1", "calls_2"):
        section = next(s for s in payload["sections"] if s["key"] == key)
        assert 0 <= section["added_calls"] <= 25, section
