"""`run_checks_in_this_process`: the suite driven by a launcher that started the ranks."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from accord.collectives import SingleDeviceCollective, TorchCollective
from accord.testing import CHECKS, Violation, run_checks_in_this_process, run_distributed


class ReversedGatherCollective(TorchCollective):
    """Returns gathered rows in reverse rank order."""

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> Any:
        return super().all_gather(tensor, out=out).flip(0)


def test_single_device_collective_passes_in_this_process() -> None:
    assert run_checks_in_this_process(SingleDeviceCollective, rank=0, world_size=1) == []


def _as_launched_rank(rank: int, world_size: int, broken: bool) -> list[Violation]:
    # run_distributed stands in for horovodrun/mpirun here: it sets RANK and WORLD_SIZE,
    # which are the defaults the runner compares the collective's identity with.
    factory = ReversedGatherCollective if broken else functools.partial(TorchCollective, "gloo")
    return run_checks_in_this_process(factory)


def test_every_rank_runs_the_suite_in_its_own_process() -> None:
    per_rank = run_distributed(_as_launched_rank, 2, False, timeout=120)
    assert per_rank == [[], []]


def test_violations_name_the_check_rank_and_world_size() -> None:
    per_rank = run_distributed(_as_launched_rank, 2, True, timeout=120)
    for rank, violations in enumerate(per_rank):
        assert "all_gather.rank_order" in {v.check for v in violations}
        assert {(v.rank, v.world_size) for v in violations} == {(rank, 2)}
        assert all(v.check in CHECKS for v in violations)


def test_unknown_check_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="Unknown conformance checks"):
        run_checks_in_this_process(SingleDeviceCollective, ["barrier", "all_reduce.median"])
