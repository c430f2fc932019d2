"""The conformance suite's one registry: names, documentation, and where each check runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accord.collectives import SingleDeviceCollective
from accord.testing import CHECKS, run_checks_in_this_process
from accord.testing.conformance.check import BOTH_MODES, Check, CheckContext, Mode
from accord.testing.conformance.runner import run_rank
from accord.testing.conformance.suite import REGISTRY, select

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "testing.md"
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<summary>.+) \| (?P<runs>[^|]+) \|$")


def _runs_at(check: Check) -> str:
    return "any world size" if check.min_world_size == 1 else f"world size ≥ {check.min_world_size}"


def test_checks_are_the_registry_names_in_order() -> None:
    assert tuple(check.name for check in REGISTRY) == CHECKS
    assert len(set(CHECKS)) == len(CHECKS)
    assert all(check.summary.strip() for check in REGISTRY)


def test_the_reference_documents_every_check_as_registered() -> None:
    rows = [m.groupdict() for m in map(ROW.match, REFERENCE.read_text().splitlines()) if m]
    documented = [(row["name"], row["summary"], row["runs"]) for row in rows]
    assert documented == [(c.name, c.summary, _runs_at(c)) for c in REGISTRY]
    # The reference says every check runs in both modes.
    assert all(check.modes == BOTH_MODES for check in REGISTRY)


def test_select_keeps_the_order_asked_for_and_rejects_unknown_names() -> None:
    assert [c.name for c in select(["barrier", "setup.identity"])] == ["barrier", "setup.identity"]
    assert select(None) == REGISTRY
    with pytest.raises(ValueError, match=r"Unknown conformance checks \['nope'\]"):
        select(["barrier", "nope"])


def _always_broken(ctx: CheckContext) -> None:
    raise RuntimeError(f"broken on rank {ctx.rank}")


@pytest.mark.parametrize(
    ("modes", "min_world_size", "runs"),
    [
        (BOTH_MODES, 1, True),
        (frozenset({Mode.IN_PROCESS}), 1, True),
        (frozenset({Mode.MULTI_PROCESS}), 1, False),
        (BOTH_MODES, 2, False),
    ],
)
def test_a_check_runs_only_in_its_modes_and_world_sizes(
    modes: frozenset[Mode], min_world_size: int, runs: bool
) -> None:
    check = Check("broken", "always raises", _always_broken, modes, min_world_size)
    found = run_rank(0, 1, SingleDeviceCollective, [check], Mode.IN_PROCESS)
    if runs:
        assert [(v.check, v.message) for v in found] == [
            ("broken", "raised RuntimeError: broken on rank 0")
        ]
    else:
        assert found == []


class FailingSetup(SingleDeviceCollective):
    """A collective whose setup() raises."""

    def setup(self, **kwargs: object) -> FailingSetup:
        raise OSError("no rendezvous")


def test_a_setup_that_raises_is_reported_as_setup_identity() -> None:
    found = run_checks_in_this_process(FailingSetup, rank=0, world_size=1)
    assert [v.check for v in found] == ["setup.identity"]
    assert "OSError: no rendezvous" in found[0].message
