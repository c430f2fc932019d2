"""InstrumentedCollective counts every call on this rank, and only the caller's calls."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accord.collectives import Collective, SingleDeviceCollective, TorchCollective
from accord.core.wrappers.debug import DebugCollective
from accord.core.wrappers.stats import CollectiveStats, InstrumentedCollective
from accord.testing import assert_conformance, run_distributed

_RUN_TIMEOUT = 120.0


def instrumented_gloo() -> Collective:
    """Conformance factory (module level, so it pickles)."""
    return InstrumentedCollective(TorchCollective("gloo"))


def test_instrumented_collective_conforms_at_2_ranks() -> None:
    assert_conformance(instrumented_gloo, world_sizes=(2,), timeout=_RUN_TIMEOUT)


def _count_calls(rank: int, world_size: int) -> dict[str, Any]:
    outer = InstrumentedCollective(TorchCollective("gloo", timeout=20.0))
    # Inside a DebugCollective: the fingerprint exchange must not show up as calls.
    inner = InstrumentedCollective(TorchCollective("gloo"))
    checked = DebugCollective(inner)
    outer.setup()
    checked.setup()
    try:
        for _ in range(3):
            outer.all_reduce(torch.ones(4))
        for src in range(world_size):
            outer.broadcast(torch.ones(2, dtype=torch.float64), src=src)
        outer.barrier()
        outer.all_gather_object({"rank": rank})
        outer.all_gather(torch.ones(3))
        for _ in range(5):
            checked.all_reduce(torch.ones(1))
        checked.barrier()
        return {
            "outer": outer.summary(),
            "inner": inner.summary(),
            "table": outer.format_table(),
            "total": outer.stats.total_calls,
        }
    finally:
        checked.teardown()
        outer.teardown()


def test_stats_count_the_right_number_of_calls_at_2_ranks() -> None:
    for rank, result in enumerate(run_distributed(_count_calls, 2, timeout=_RUN_TIMEOUT)):
        outer = result["outer"]
        assert {op: row["calls"] for op, row in outer.items()} == {
            "all_reduce": 3,
            "broadcast": 2,
            "barrier": 1,
            "all_gather_object": 1,
            "all_gather": 1,
        }, rank
        assert outer["all_reduce"]["bytes"] == 3 * 4 * 4
        assert outer["broadcast"]["bytes"] == 2 * 2 * 8
        assert all(row["seconds"] > 0 and row["errors"] == 0 for row in outer.values())
        assert result["total"] == 8
        # Only the calls made through `checked`, not its fingerprint all_gathers.
        assert {op: row["calls"] for op, row in result["inner"].items()} == {
            "all_reduce": 5,
            "barrier": 1,
        }
        for op in outer:
            assert op in result["table"]


def test_failed_calls_are_counted_as_errors() -> None:
    c = InstrumentedCollective(SingleDeviceCollective()).setup()
    c.all_reduce(torch.ones(2))
    with pytest.raises(ValueError, match="Unsupported reduce op"):
        c.all_reduce(torch.ones(2), "median")
    with pytest.raises(NotImplementedError, match="single device"):
        c.send(torch.ones(1), dst=0)
    assert c.stats["all_reduce"].calls == 2
    assert c.stats["all_reduce"].errors == 1
    assert c.stats["send"].errors == 1
    assert c.stats["never_called"].calls == 0
    assert "never_called" not in c.stats


def test_summary_and_table() -> None:
    stats = CollectiveStats()
    stats.record("all_reduce", 0.5, 1024)
    stats.record("all_reduce", 0.25, 1024)
    stats.record("barrier", 1.0)
    summary = stats.summary()
    assert list(summary) == ["barrier", "all_reduce"]  # most time first
    assert summary["all_reduce"] == {
        "calls": 2,
        "seconds": 0.75,
        "mean_ms": 375.0,
        "bytes": 2048,
        "errors": 0,
    }
    table = stats.format_table()
    lines = table.splitlines()
    assert lines[0] == "Collective calls"
    assert lines[1].split() == ["op", "calls", "total", "s", "mean", "ms", "MiB", "errors"]
    assert lines[-1].split()[:3] == ["total", "3", "1.7500"]
    assert len({len(line) for line in lines[1:]}) == 1  # aligned
    shared = InstrumentedCollective(SingleDeviceCollective(), stats).setup()
    shared.barrier()
    assert stats["barrier"].calls == 2
    stats.reset()
    assert stats.summary() == {}
    assert stats.format_table(title=None).splitlines()[-1].split()[:2] == ["total", "0"]
