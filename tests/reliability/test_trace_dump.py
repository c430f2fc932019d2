"""A hang leaves each rank's last collective calls behind, and `python -m accord.trace`
names the call where the ranks parted, the rank that was missing, and the lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from accord.collectives import TorchCollective
from accord.core.wrappers.policy import wrap_collective
from accord.errors import CollectiveError
from accord.testing import run_distributed
from accord.trace import first_divergence, load
from tests.helpers.processes import run_python

SCRIPT = Path(__file__).parent / "scripts" / "skip_barrier.py"
THIS_FILE = str(Path(__file__).resolve())


def _line(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.timeout(240)
def test_a_script_where_rank_1_skips_a_barrier_leaves_dumps_the_command_reads(
    tmp_path: Path,
) -> None:
    result = run_python(
        [str(SCRIPT), str(tmp_path)],
        env={"ACCORD_COLLECTIVE_TIMEOUT": "20", "ACCORD_TRACE_DIR": ""},
        timeout=200,
        check=False,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    # Without ACCORD_TRACE_DIR, and without a logger, the dumps go under default_root_dir.
    traces = tmp_path / "accord_traces"
    dumps = sorted(p.name for p in traces.glob("collectives-rank*.json"))
    assert dumps == ["collectives-rank0.json", "collectives-rank1.json"], result.stderr
    assert f"{traces / 'collectives-rank0.json'}" in result.stderr
    assert "CollectiveMismatchError" in result.stderr

    report = run_python(["-m", "accord.trace", str(traces)], timeout=60).stdout
    barrier = _line(SCRIPT, 'trainer.strategy.barrier("sync")')
    reduce = _line(SCRIPT, "trainer.strategy.reduce(torch.tensor(1.0))")
    lines = report.splitlines()
    first = next(line for line in lines if line.startswith("First call where the ranks differ"))
    assert f"barrier at {SCRIPT}:{barrier} in on_train_batch_end" in first
    seq = first.split("#", 1)[1].split(",", 1)[0]
    assert f"Ranks missing from barrier #{seq}: [1]" in report
    rank0 = next(line for line in lines if line.startswith("  rank 0: "))
    rank1 = next(line for line in lines if line.startswith("  rank 1: "))
    assert "barrier(name='sync')" in rank0 and f"{SCRIPT}:{barrier}" in rank0
    assert "all_reduce(" in rank1 and f"{SCRIPT}:{reduce}" in rank1

    summary = run_python(["-m", "accord.trace", str(traces), "--summary"], timeout=60).stdout
    assert "all_reduce" in summary and "waiting s" in summary


@pytest.mark.timeout(120)
def test_on_a_mismatch_rank_0_lets_the_other_ranks_finish_their_failure(tmp_path: Path) -> None:
    # Every rank raises the mismatch; rank 1 takes two seconds in its on_exception hook.
    # Rank 0's launcher must not kill it meanwhile (it writes its trace there too).
    result = run_python(
        [str(SCRIPT), str(tmp_path), "slow-exit"],
        env={"ACCORD_COLLECTIVE_TIMEOUT": "10", "ACCORD_TRACE_DIR": ""},
        timeout=100,
        check=False,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    assert "rank 1 handled CollectiveMismatchError" in result.stdout, result.stderr
    dumps = sorted(p.name for p in (tmp_path / "accord_traces").glob("collectives-rank*.json"))
    assert dumps == ["collectives-rank0.json", "collectives-rank1.json"], result.stderr


_TIMEOUT = "2"
_LATE_BY = 3.5  # past rank 0's timeout, within its teardown grace (5 s)


def _stays_away(rank: int, world_size: int) -> str:
    collective = wrap_collective(TorchCollective("gloo", timeout=30.0))
    collective.setup()
    try:
        collective.all_reduce(torch.ones(3))
        collective.all_gather(torch.ones(2))
        if rank != 1:
            collective.barrier("sync")  # rank 1 skips it
        else:
            time.sleep(_LATE_BY)
        collective.all_reduce(torch.ones(1))  # rank 1 arrives here, too late
        return "no error"
    except CollectiveError as err:
        return str(err)
    finally:
        collective.teardown()


@pytest.mark.timeout(180)
def test_a_watchdog_timeout_leaves_a_dump_on_every_rank_that_can_write(tmp_path: Path) -> None:
    env = {"ACCORD_COLLECTIVE_TIMEOUT": _TIMEOUT, "ACCORD_TRACE_DIR": str(tmp_path)}
    messages = run_distributed(_stays_away, 2, env=env, timeout=120)
    for rank, message in enumerate(messages):
        assert f"{tmp_path / f'collectives-rank{rank}.json'}" in message
        assert f"python -m accord.trace {tmp_path}" in message
    assert "waited 2 s in barrier" in messages[0]

    ranks = load(tmp_path)
    divergence = first_divergence(ranks)
    assert divergence is not None
    assert (divergence.seq, divergence.expected["op"], divergence.missing) == (3, "barrier", [1])
    states = {rank: call["state"] for rank, call in divergence.calls.items() if call}
    # Rank 1 normally learns that rank 0 gave up; on a host so loaded that it arrives
    # after rank 0 has gone, it loses contact with rank 0's store instead.
    assert states[0] == "timeout" and states[1] in ("abandoned", "failed")
    barrier = _line(Path(THIS_FILE), 'collective.barrier("sync")  # rank 1 skips it')
    assert divergence.expected["site"] == f"{THIS_FILE}:{barrier} in _stays_away"
    assert ranks[0].missing_ranks == [1]

    # A rank killed before it could write: the waiting rank's file still names it.
    (tmp_path / "collectives-rank1.json").unlink()
    alone = first_divergence(load(tmp_path))
    assert alone is not None
    assert (alone.seq, alone.missing, alone.no_dump) == (3, [1], [1])
    report = run_python(["-m", "accord.trace", str(tmp_path)], timeout=60).stdout
    assert "rank 1: left no dump" in report and "Ranks missing from barrier #3: [1]" in report
