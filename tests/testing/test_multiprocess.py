"""run_distributed reports the rank that failed, and never leaves a process behind, whether
its ranks are spawned or forked from the fork server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from accord.errors import RankFailureError
from accord.testing import StartMethod, run_distributed, set_start_method
from tests.helpers.processes import RANK_PRELOAD

METHODS: list[StartMethod] = ["spawn", "forkserver"]


def _identity(rank: int, world_size: int, tag: str) -> tuple[int, int, str, str]:
    return rank, world_size, tag, os.environ["OMP_NUM_THREADS"]


def _fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one is broken")
    return rank


def _hangs(rank: int, world_size: int) -> None:
    import time

    time.sleep(60)


def _surroundings(rank: int, world_size: int) -> tuple[str | None, str, str, list[str]]:
    return (
        os.environ.get("ACCORD_TEST_MARK"),
        os.environ["RANK"],
        str(Path.cwd()),
        sys.path,
    )


@pytest.mark.parametrize("method", METHODS)
def test_results_come_back_in_rank_order(method: StartMethod) -> None:
    results = run_distributed(_identity, 3, "x", start_method=method)
    assert [r[:3] for r in results] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    assert all(int(r[3]) >= 1 for r in results)


@pytest.mark.parametrize("method", METHODS)
def test_a_failing_rank_is_named_with_its_traceback(method: StartMethod) -> None:
    with pytest.raises(RankFailureError, match=r"Rank 1 failed(.|\n)*rank one is broken"):
        run_distributed(_fails_on_rank_one, 2, start_method=method)


@pytest.mark.parametrize("method", METHODS)
def test_a_hang_becomes_an_error(method: StartMethod) -> None:
    with pytest.raises(RankFailureError, match=r"timed out|did not finish|seconds"):
        run_distributed(_hangs, 2, timeout=3, start_method=method)


@pytest.mark.parametrize("method", METHODS)
def test_ranks_see_the_callers_environment_directory_and_path(
    method: StartMethod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Set after the fork server may have started: a forked rank must still see them.
    monkeypatch.setenv("ACCORD_TEST_MARK", f"set for {method}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    results = run_distributed(_surroundings, 2, start_method=method)
    for rank, (mark, rank_variable, cwd, path) in enumerate(results):
        assert mark == f"set for {method}"
        assert rank_variable == str(rank)
        assert Path(cwd).resolve() == tmp_path.resolve()
        assert str(tmp_path) in path


def test_the_chosen_start_method_applies_to_later_runs() -> None:
    # The suite's conftest chose the fork server; a spawned rank's parent is this process.
    set_start_method("spawn")
    try:
        (parent,) = run_distributed(_parent, 1)
        assert parent == os.getpid()
    finally:
        set_start_method("forkserver", preload=RANK_PRELOAD)
    (parent,) = run_distributed(_parent, 1)
    assert parent != os.getpid()


def _parent(rank: int, world_size: int) -> int:
    return os.getppid()


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="'spawn' or 'forkserver'"):
        set_start_method("fork")  # type: ignore[arg-type]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_identity, 0, "x")
