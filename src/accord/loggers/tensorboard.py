"""`TensorBoardLogger`: metrics as TensorBoard scalars (needs the ``tensorboard`` package)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing_extensions import override

from accord.imports import require
from accord.loggers.logger import Logger

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(Logger):
    """Write event files to ``<save_dir>/<name>/version_<n>/``.

    Args:
        save_dir: the root directory.
        name: the experiment's sub-directory.
        version: the run's number (default: the next free one).

    Raises:
        MissingDependencyError: tensorboard is not installed.
    """

    def __init__(
        self, save_dir: str | Path = ".", name: str = "logs", version: int | None = None
    ) -> None:
        require("tensorboard", "TensorBoardLogger")
        super().__init__(save_dir, name, version)
        self._writer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    @property
    def experiment(self) -> Any:
        """The `torch.utils.tensorboard.SummaryWriter` (created on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.experiment.add_scalar(key, float(value), step)

    @override
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in params.items()
        }
        self.experiment.add_text("hparams", "\n".join(f"{k}: {v}" for k, v in sorted(flat.items())))

    @override
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @override
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
