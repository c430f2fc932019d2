"""`CSVLogger`: metrics as rows of ``metrics.csv``, hyperparameters as ``hparams.json``."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing_extensions import override

from accord.loggers.logger import Logger

__all__ = ["CSVLogger"]


class CSVLogger(Logger):
    """Write metrics to ``<save_dir>/<name>/version_<n>/metrics.csv``.

    As in Lightning, each row has a ``step`` (optimizer steps done before the batch that
    logged, so the first is 0) and, from the Trainer, the ``epoch``.

    Rows are buffered and the file is rewritten whole when a new column appears, so the
    header always lists every metric.

    Args:
        save_dir: the root directory.
        name: the experiment's sub-directory.
        version: the run's number (default: the next free one).
        flush_every: write to disk every this many `log_metrics` calls.
    """

    def __init__(
        self,
        save_dir: str | Path = ".",
        name: str = "logs",
        version: int | None = None,
        flush_every: int = 50,
    ) -> None:
        super().__init__(save_dir, name, version)
        self.flush_every = max(1, flush_every)
        self.rows: list[dict[str, Any]] = []
        self._written = 0
        self._columns: list[str] = []

    @property
    def metrics_file(self) -> Path:
        """The CSV file."""
        return self.log_dir / "metrics.csv"

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        values = {k: v if isinstance(v, int) else float(v) for k, v in metrics.items()}
        self.rows.append({"step": step, **values})
        if len(self.rows) - self._written >= self.flush_every:
            self.save()

    @override
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(params), indent=2, default=str, sort_keys=True)
        (self.log_dir / "hparams.json").write_text(text + "\n")

    @override
    def save(self) -> None:
        if len(self.rows) == self._written:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        rewrite = columns != self._columns or self._written == 0
        mode = "w" if rewrite else "a"
        start = 0 if rewrite else self._written
        with self.metrics_file.open(mode, newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            if rewrite:
                writer.writeheader()
            writer.writerows(self.rows[start:])
        self._columns = columns
        self._written = len(self.rows)
