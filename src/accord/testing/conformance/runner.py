"""The runners: the suite on one rank, in fresh processes per world size, or in this process."""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Sequence

import torch

from accord.core.env_vars import env_number
from accord.testing.conformance.check import Check, CheckContext, CollectiveFactory, Mode
from accord.testing.conformance.expect import BrokenContractError
from accord.testing.conformance.report import ConformanceReport, Violation
from accord.testing.conformance.suite import select
from accord.testing.multiprocess import run_distributed

__all__ = [
    "assert_conformance",
    "run_checks_in_this_process",
    "run_conformance",
    "run_rank",
]


def run_rank(
    rank: int,
    world_size: int,
    factory: CollectiveFactory,
    checks: Sequence[Check],
    mode: Mode,
) -> list[Violation]:
    """Set a collective from ``factory`` up, run each check that applies, tear it down.

    ``rank`` and ``world_size`` are what the launcher assigned this process.

    Returns:
        This rank's violations, in check order; a ``setup()`` that raises is reported
        as a violation of ``setup.identity`` and no check runs.
    """

    def violation(check: str, message: str) -> Violation:
        return Violation(check, world_size, rank, message)

    collective = factory()
    try:
        collective.setup()
    except Exception:
        return [violation("setup.identity", "setup() raised:\n" + traceback.format_exc())]
    ctx = CheckContext(collective, factory, rank, world_size)
    found: list[Violation] = []
    # The checks' tensors are made on the device the backend moves data on (CUDA for
    # nccl), since a GPU-only backend cannot reduce CPU tensors.
    try:
        with torch.device(collective.object_device):
            for check in checks:
                try:
                    if check.applies(mode, collective.world_size):
                        check.run(ctx)
                except BrokenContractError as err:
                    found.append(violation(check.name, str(err)))
                except Exception as err:
                    found.append(violation(check.name, f"raised {type(err).__name__}: {err}"))
    finally:
        collective.teardown()
    return found


def run_conformance(
    factory: CollectiveFactory,
    world_sizes: Iterable[int] = (1, 2, 3),
    *,
    checks: Iterable[str] | None = None,
    timeout: float = 180.0,
) -> ConformanceReport:
    """Run the conformance suite on ``factory``'s collectives and report every violation.

    Args:
        factory: a picklable callable (a class, a module-level function or a
            `functools.partial` of one) returning a collective that is not set up.
        world_sizes: the process counts to run the suite at.
        checks: a subset of `CHECKS` (default: all of them).
        timeout: seconds each world size may take before its processes are stopped.

    Raises:
        ValueError: an unknown check name.
        RankFailureError: a rank crashed or hung (a collective that deadlocks).
    """
    selected = select(checks)
    sizes = tuple(world_sizes)
    report = ConformanceReport(world_sizes=sizes, checks=tuple(c.name for c in selected))
    for size in sizes:
        per_rank = run_distributed(
            run_rank, size, factory, selected, Mode.MULTI_PROCESS, timeout=timeout
        )
        for violations in per_rank:
            report.violations.extend(violations)
    return report


def run_checks_in_this_process(
    factory: CollectiveFactory,
    checks: Iterable[str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> list[Violation]:
    """Run the suite in this process, as one rank of a job that a launcher started.

    For backends whose processes an outside launcher starts (``horovodrun``, ``mpirun``,
    a cluster's job runner), where `run_conformance` cannot start them itself: every
    process of the job calls this with the same ``checks``, and the suite sets a
    collective from ``factory`` up, runs each check and tears it down, as in
    `run_conformance`.

    Args:
        factory: returns a collective that is not set up (it need not be picklable).
        checks: a subset of `CHECKS` (default: all of them).
        rank, world_size: what the launcher assigned this process, which
            ``setup.identity`` compares the collective's rank and world size with;
            default: ``RANK`` and ``WORLD_SIZE`` from the environment, else 0 and 1.

    Returns:
        This rank's violations (empty when it kept the contract). The suite's
        collective is torn down by then, so report them per rank (print them, or
        write a file per rank) and combine the ranks' lists outside the job.

    Raises:
        ValueError: an unknown check name.
    """
    selected = select(checks)
    rank = env_number("RANK", int, 0) if rank is None else rank
    world_size = env_number("WORLD_SIZE", int, 1) if world_size is None else world_size
    return run_rank(rank, world_size, factory, selected, Mode.IN_PROCESS)


def assert_conformance(
    factory: CollectiveFactory,
    world_sizes: Iterable[int] = (1, 2, 3),
    *,
    checks: Iterable[str] | None = None,
    timeout: float = 180.0,
) -> None:
    """Run `run_conformance` and raise `ConformanceError` (an AssertionError) on any violation.

    The pytest-friendly form: call it in a test, or parametrize over `CHECKS` and pass
    ``checks=[name]`` for one test per contract line.
    """
    run_conformance(factory, world_sizes, checks=checks, timeout=timeout).raise_for_violations()
