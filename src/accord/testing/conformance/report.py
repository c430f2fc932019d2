"""What a conformance run found: `Violation`, `ConformanceReport` and `ConformanceError`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConformanceError", "ConformanceReport", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One contract line a collective broke, on one rank of one world size."""

    check: str
    world_size: int
    rank: int
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] world_size={self.world_size} rank={self.rank}: {self.message}"


@dataclass
class ConformanceReport:
    """What `run_conformance` found: the checks it ran and the violations, if any."""

    world_sizes: tuple[int, ...]
    checks: tuple[str, ...]
    violations: list[Violation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no contract line was violated."""
        return not self.violations

    @property
    def failed_checks(self) -> list[str]:
        """Names of the violated contract lines, each once, in suite order."""
        seen = {v.check for v in self.violations}
        return [name for name in self.checks if name in seen]

    def raise_for_violations(self) -> None:
        """Raise `ConformanceError` listing every violation, if there is any."""
        if self.violations:
            raise ConformanceError(self)


class ConformanceError(AssertionError):
    """A collective broke its contract; the message names each violated line."""

    def __init__(self, report: ConformanceReport) -> None:
        self.report = report
        lines = "\n".join(f"  {v}" for v in report.violations)
        super().__init__(
            f"{len(report.violations)} violation(s) of the collective contract in "
            f"{report.failed_checks}:\n{lines}"
        )
