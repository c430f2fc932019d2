"""run_distributed reports the rank that failed, and never leaves a process behind."""

from __future__ import annotations

import os

import pytest

from accord.errors import RankFailureError
from accord.testing import run_distributed


def _identity(rank: int, world_size: int, tag: str) -> tuple[int, int, str, str]:
    return rank, world_size, tag, os.environ["OMP_NUM_THREADS"]


def _fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one is broken")
    return rank


def _hangs(rank: int, world_size: int) -> None:
    import time

    time.sleep(60)


def test_results_come_back_in_rank_order() -> None:
    results = run_distributed(_identity, 3, "x")
    assert [r[:3] for r in results] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    assert all(int(r[3]) >= 1 for r in results)


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(RankFailureError, match=r"Rank 1 failed(.|\n)*rank one is broken"):
        run_distributed(_fails_on_rank_one, 2)


def test_a_hang_becomes_an_error() -> None:
    with pytest.raises(RankFailureError, match=r"timed out|did not finish|seconds"):
        run_distributed(_hangs, 2, timeout=3)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_identity, 0, "x")
