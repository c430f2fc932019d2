"""The conformance suite passes on the shipped collectives and names what broken ones break."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from accord.collectives import ReduceOpLike, SingleDeviceCollective, TorchCollective
from accord.testing import CHECKS, ConformanceError, assert_conformance, run_conformance


def test_torch_collective_conforms_at_1_2_3_ranks() -> None:
    assert_conformance(functools.partial(TorchCollective, "gloo"), world_sizes=(1, 2, 3))


def test_single_device_collective_conforms() -> None:
    assert_conformance(SingleDeviceCollective, world_sizes=(1, 2, 3))


class MutatingCollective(TorchCollective):
    """Reduces into the caller's tensor instead of a new one."""

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        result = super().all_reduce(tensor, op, out=out)
        if tensor.dtype == result.dtype and tensor.shape == result.shape:
            tensor.copy_(result)
        return result


class TruncatingMeanCollective(TorchCollective):
    """Keeps the integer dtype for mean, so 1/2 becomes 0."""

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        name = str(op).lower()
        if name in ("mean", "avg") and not tensor.is_floating_point() and out is None:
            total = super().all_reduce(tensor, "sum")
            return total // self.world_size
        return super().all_reduce(tensor, op, out=out)


class ReversedGatherCollective(TorchCollective):
    """Returns gathered rows in reverse rank order."""

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> Any:
        return super().all_gather(tensor, out=out).flip(0)


@pytest.mark.parametrize(
    ("factory", "broken"),
    [
        (MutatingCollective, "inputs_unchanged"),
        (TruncatingMeanCollective, "all_reduce.integer_mean"),
        (ReversedGatherCollective, "all_gather.rank_order"),
    ],
)
def test_suite_names_the_broken_contract_line(factory: Any, broken: str) -> None:
    report = run_conformance(factory, world_sizes=(2,))
    assert not report.passed
    assert broken in report.failed_checks
    with pytest.raises(ConformanceError, match=broken.replace(".", r"\.")):
        report.raise_for_violations()


def test_broken_mean_is_also_caught_by_the_mean_check() -> None:
    report = run_conformance(TruncatingMeanCollective, world_sizes=(2,), checks=["all_reduce.mean"])
    assert report.failed_checks == ["all_reduce.mean"]
    assert all(v.world_size == 2 for v in report.violations)
    assert {v.rank for v in report.violations} == {0, 1}


def test_unknown_check_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="Unknown conformance checks"):
        run_conformance(SingleDeviceCollective, checks=["all_reduce.median"])


def test_checks_are_listed_by_name() -> None:
    assert "setup.join_existing" in CHECKS
    assert len(set(CHECKS)) == len(CHECKS)
