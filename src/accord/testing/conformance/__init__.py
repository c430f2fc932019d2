"""The collective conformance suite: every line of the `Collective` contract, checked in
real processes.

Point it at any `Collective` factory (a class, or a picklable callable returning a
collective that has not been set up)::

    from accord.testing import assert_conformance
    assert_conformance(MyCollective, world_sizes=(1, 2, 3))

Each world size runs in fresh processes started by `run_distributed`, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and the suite calls
``collective.setup()`` with no arguments. Expected values are computed from the
collective's own ``rank`` and ``world_size``, so a collective that is local to each
process (world size 1) is checked as such. Every violated contract line is reported by
name (``"all_reduce.mean"``, ``"inputs_unchanged"``, ...), per rank and world size.

The checks live in one registry (`suite.REGISTRY`): each `Check` holds its name, what it
checks, and the modes and world sizes it runs in; every runner iterates that registry.
"""

from accord.testing.conformance.report import ConformanceError, ConformanceReport, Violation
from accord.testing.conformance.runner import (
    assert_conformance,
    run_checks_in_this_process,
    run_conformance,
)
from accord.testing.conformance.suite import CHECKS

__all__ = [
    "CHECKS",
    "ConformanceError",
    "ConformanceReport",
    "Violation",
    "assert_conformance",
    "run_checks_in_this_process",
    "run_conformance",
]
