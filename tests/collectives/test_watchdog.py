"""WatchdogCollective: a rank that does not arrive turns a hang into a named error."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import pytest
import torch

from accord.collectives import Collective, SingleDeviceCollective, TorchCollective
from accord.core.timeouts import TIMEOUT_ENV_VAR
from accord.core.wrappers.policy import maybe_watchdog
from accord.core.wrappers.watchdog import WatchdogCollective
from accord.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
)
from accord.testing import assert_conformance, run_distributed

_RUN_TIMEOUT = 120.0
_WATCHDOG_TIMEOUT = 2.0
# The late rank arrives after the other gave up, within rank 0's teardown grace (5 s).
_LATE_BY = 3.5


def watched_gloo() -> Collective:
    """Conformance factory (module level, so it pickles)."""
    return WatchdogCollective(TorchCollective("gloo"), 60.0)


def test_watchdog_collective_conforms_at_1_and_2_ranks() -> None:
    assert_conformance(watched_gloo, world_sizes=(1, 2), timeout=_RUN_TIMEOUT)


def _late_rank(rank: int, world_size: int, late: int) -> dict[str, Any]:
    # What accord logs on this rank (its stacks on a timeout), read back here.
    log = io.StringIO()
    logging.getLogger("accord").addHandler(logging.StreamHandler(log))
    c = WatchdogCollective(TorchCollective("gloo", timeout=30.0), _WATCHDOG_TIMEOUT)
    c.setup()
    c.barrier("start")
    outcome: dict[str, Any] = {"type": None}
    start = time.monotonic()
    try:
        if rank == late:
            time.sleep(_LATE_BY)
        c.all_reduce(torch.ones(2))
    except CollectiveTimeoutError as err:
        outcome.update(
            type=type(err).__name__,
            message=str(err),
            op=err.op,
            rank=err.rank,
            missing=err.missing_ranks,
        )
    outcome["waited"] = time.monotonic() - start
    try:
        c.barrier()
    except CollectiveError as err:
        outcome["next_op"] = str(err)
    c.teardown()
    outcome["log"] = log.getvalue()
    return outcome


@pytest.mark.parametrize("late", [1, 0], ids=["late_rank_1", "late_store_host_rank_0"])
def test_a_rank_that_does_not_arrive_is_named(late: int) -> None:
    results = run_distributed(_late_rank, 2, late, timeout=_RUN_TIMEOUT)
    waiting, late_one = results[1 - late], results[late]
    other = 1 - late
    assert waiting["type"] == "CollectiveTimeoutError", waiting
    assert (waiting["op"], waiting["rank"], waiting["missing"]) == ("all_reduce", other, [late])
    message = waiting["message"]
    assert f"Rank {other} waited 2 s in all_reduce" in message
    assert f"for ranks [{late}], which have not arrived" in message
    # What the missing rank did last: the named barrier, from this file.
    assert f"rank {late}: last entered call #1: barrier at {__file__}:" in message
    assert waiting["waited"] < _LATE_BY  # it did not wait for the late rank
    # Its stacks went to accord's log, with this test's worker in them.
    assert f"accord watchdog, rank {other}: " in waiting["log"]
    assert "most recent call first" in waiting["log"]
    assert "_late_rank" in waiting["log"]
    # The late rank learns, when it arrives, that the call was abandoned, and fails too.
    assert late_one["type"] == "CollectiveTimeoutError", late_one
    assert (
        f"was abandoned: rank {other} waited 2 s in all_reduce for ranks [{late}]"
        in late_one["message"]
    )
    assert late_one["missing"] == [late]
    # After a timeout the collective refuses to go on (the ranks are out of step).
    assert "already failed" in waiting["next_op"]
    assert "already failed" in late_one["next_op"]


def _different_ops(rank: int, world_size: int) -> dict[str, Any]:
    c = WatchdogCollective(TorchCollective("gloo", timeout=20.0), 30.0).setup()
    outcome: dict[str, Any] = {"type": None}
    try:
        if rank == 0:
            c.all_reduce(torch.ones(2))
        else:
            c.barrier()
    except CollectiveMismatchError as err:
        outcome.update(type=type(err).__name__, message=str(err), calls=err.calls)
    outcome["after"] = c.all_reduce(torch.ones(1)).item()
    c.teardown()
    return outcome


def test_ranks_arriving_with_different_ops_fail_instead_of_hanging() -> None:
    for result in run_distributed(_different_ops, 2, timeout=_RUN_TIMEOUT):
        assert result["type"] == "CollectiveMismatchError", result
        assert "rank 0: all_reduce [call #1] at" in result["message"]
        assert "rank 1: barrier [call #1] at" in result["message"]
        assert [c["op"] for c in result["calls"]] == ["all_reduce", "barrier"]
        assert result["after"] == 2.0


def test_maybe_watchdog_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = SingleDeviceCollective()
    monkeypatch.delenv(TIMEOUT_ENV_VAR, raising=False)
    assert maybe_watchdog(plain) is plain
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "0")
    assert maybe_watchdog(plain) is plain
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "90")
    watched = maybe_watchdog(plain)
    assert isinstance(watched, WatchdogCollective)
    assert watched.timeout.total_seconds() == 90
    assert maybe_watchdog(watched) is watched
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "soon")
    with pytest.raises(ConfigurationError, match=TIMEOUT_ENV_VAR):
        maybe_watchdog(plain)


def test_one_rank_needs_no_store() -> None:
    c = WatchdogCollective(SingleDeviceCollective(), 1.0).setup()
    assert c.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    c.barrier()
    c.teardown()
    with pytest.raises(ValueError, match="positive"):
        WatchdogCollective(SingleDeviceCollective(), 0)
