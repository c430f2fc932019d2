"""`Logger`: where metrics go. The Trainer calls loggers on global rank zero only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Logger", "next_version"]


class Logger(ABC):
    """Base class of the metric loggers: each run writes to ``<save_dir>/<name>/version_<n>``.

    Args:
        save_dir: the root directory.
        name: the experiment's sub-directory.
        version: the run's number (default: the next free one, chosen on first use).
    """

    def __init__(
        self, save_dir: str | Path = ".", name: str = "logs", version: int | None = None
    ) -> None:
        self.save_dir = Path(save_dir)
        self.name = name
        self._version = version

    @property
    def version(self) -> int:
        """The run's number."""
        if self._version is None:
            self._version = next_version(self.save_dir / self.name)
        return self._version

    @property
    def log_dir(self) -> Path:
        """The directory this run writes to."""
        return self.save_dir / self.name / f"version_{self.version}"

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step``."""

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def save(self) -> None:
        """Flush what is buffered to disk."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` (``"success"`` or ``"failed"``); close files."""
        self.save()


def next_version(root: Path) -> int:
    """One more than the highest ``version_N`` directory under ``root`` (0 when none)."""
    if not root.is_dir():
        return 0
    numbers = [
        int(entry.name.split("_", 1)[1])
        for entry in root.iterdir()
        if entry.is_dir() and entry.name.startswith("version_") and entry.name[8:].isdigit()
    ]
    return max(numbers, default=-1) + 1
