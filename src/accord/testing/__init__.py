"""Public test kit: multi-process helpers, the collective conformance suite, and the
strategy equivalence check."""

from accord.testing.conformance import (
    CHECKS,
    ConformanceError,
    ConformanceReport,
    Violation,
    assert_conformance,
    run_checks_in_this_process,
    run_conformance,
)
from accord.testing.equivalence import (
    DEFAULT_TOLERANCES,
    StrategySpec,
    TrainingRecord,
    assert_strategies_agree,
)
from accord.testing.multiprocess import StartMethod, run_distributed, set_start_method

__all__ = [
    "CHECKS",
    "DEFAULT_TOLERANCES",
    "ConformanceError",
    "ConformanceReport",
    "StartMethod",
    "StrategySpec",
    "TrainingRecord",
    "Violation",
    "assert_conformance",
    "run_checks_in_this_process",
    "run_conformance",
    "run_distributed",
    "set_start_method",
    "assert_strategies_agree",
]
