"""Public test kit: multi-process helpers and the collective conformance suite."""

from accord.testing.conformance import (
    CHECKS,
    ConformanceError,
    ConformanceReport,
    Violation,
    assert_conformance,
    run_checks_in_this_process,
    run_conformance,
)
from accord.testing.multiprocess import run_distributed

__all__ = [
    "CHECKS",
    "ConformanceError",
    "ConformanceReport",
    "Violation",
    "assert_conformance",
    "run_checks_in_this_process",
    "run_conformance",
    "run_distributed",
]
