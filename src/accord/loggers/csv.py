"""`CSVLogger`: metrics as rows of ``metrics.csv``, hyperparameters as ``hparams.json``."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from accord.errors import ConfigurationError
from accord.loggers.logger import _DirectoryLogger, add_prefix

__all__ = ["CSVLogger", "ExperimentWriter"]


class ExperimentWriter:
    """What `CSVLogger.experiment` is: the writer of one run's ``metrics.csv`` and
    ``hparams.json``, with the methods of Lightning's ``ExperimentWriter``.

    Rows are kept in memory until `save`, which appends them; when a row brings a new
    column the file is rewritten with the wider header, so it always lists every metric.
    Columns are in the order they first appeared (``step`` first).

    Args:
        log_dir: the run's directory.
    """

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.json"

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.metrics_file_path = self.log_dir / self.NAME_METRICS_FILE
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}

    def log_metrics(self, metrics_dict: Mapping[str, Any], step: int | None = None) -> None:
        """Add a row with ``metrics_dict`` at ``step`` (default: the number of rows so far)."""
        if step is None:
            step = len(self.metrics)
        self.metrics.append({"step": step, **{k: _plain(v) for k, v in metrics_dict.items()}})

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Add ``params`` to the hyperparameters and rewrite ``hparams.json``."""
        self.hparams.update(params)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.hparams, indent=2, default=str, sort_keys=True)
        (self.log_dir / self.NAME_HPARAMS_FILE).write_text(text + "\n")

    def save(self) -> None:
        """Write the rows logged since the last save."""
        if not self.metrics:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        known = len(self.metrics_keys)
        self.metrics_keys.extend(
            dict.fromkeys(k for row in self.metrics for k in row if k not in self.metrics_keys)
        )
        exists = self.metrics_file_path.is_file()
        if exists and len(self.metrics_keys) > known:
            with self.metrics_file_path.open(newline="") as handle:
                earlier = list(csv.DictReader(handle))
            self._write("w", earlier + self.metrics)
        else:
            self._write("a" if exists else "w", self.metrics)
        self.metrics = []

    def _write(self, mode: str, rows: list[dict[str, Any]]) -> None:
        with self.metrics_file_path.open(mode, newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.metrics_keys)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value if isinstance(value, int | str) else float(value)


class CSVLogger(_DirectoryLogger):
    """Write metrics to ``<save_dir>/<name>/<version>/metrics.csv``.

    As in Lightning, each row has a ``step`` (optimizer steps done before the batch that
    logged, so the first is 0) and, from the Trainer, the ``epoch``. Hyperparameters go to
    ``hparams.json`` in the same directory (Lightning writes ``hparams.yaml``).

    Args:
        save_dir: the root directory.
        name: the experiment's sub-directory (``""`` or None: none).
        version: the run's number, or its directory name as a string (default: the next
            free number).
        prefix: put before every metric name, joined with ``"-"``.
        flush_logs_every_n_steps: write the rows to disk when a row's ``step + 1`` is a
            multiple of this (and at the end of each run).

    Raises:
        ConfigurationError: ``flush_logs_every_n_steps`` below 1.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | Path = ".",
        name: str | None = "logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if isinstance(flush_logs_every_n_steps, bool) or flush_logs_every_n_steps < 1:
            raise ConfigurationError(
                f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}) must be an "
                "int >= 1."
            )
        super().__init__(save_dir, name, version)
        self._prefix = prefix
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._experiment: ExperimentWriter | None = None

    @property
    def experiment(self) -> ExperimentWriter:
        """The run's `ExperimentWriter` (created on first use)."""
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir)
        return self._experiment

    @property
    def metrics_file(self) -> Path:
        """The CSV file."""
        return self.log_dir / ExperimentWriter.NAME_METRICS_FILE

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        metrics = add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        if step is None:
            step = len(self.experiment.metrics)
        self.experiment.log_metrics(metrics, step)
        if (step + 1) % self._flush_logs_every_n_steps == 0:
            self.save()

    @override
    def log_hyperparams(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        self.experiment.log_hparams(params)

    @override
    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()
