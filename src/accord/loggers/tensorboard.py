"""`TensorBoardLogger`: metrics as TensorBoard scalars (needs the ``tensorboard`` package)."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from accord.core.buffers import move_to_device
from accord.errors import ConfigurationError
from accord.imports import require
from accord.loggers.logger import _DirectoryLogger, add_prefix

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(_DirectoryLogger):
    """Write event files to ``<save_dir>/<name>/<version>/`` (``/<sub_dir>`` if given).

    As in Lightning, `log_hyperparams` writes the hyperparameters to TensorBoard's
    HParams view (nested dicts flattened with ``/``, values other than numbers, strings,
    booleans and tensors as their ``str``), with a placeholder metric ``hp_metric`` of
    -1 unless ``default_hp_metric=False`` or metrics are given.

    Args:
        save_dir: the root directory.
        name: the experiment's sub-directory (``""`` or None: none).
        version: the run's number, or its directory name as a string (default: the next
            free number).
        log_graph: write the module's graph when a fit starts (the module needs an
            ``example_input_array``).
        default_hp_metric: log ``hp_metric`` = -1 with hyperparameters given without metrics.
        prefix: put before every metric name, joined with ``"-"``.
        sub_dir: a directory under the version's for the event files.
        kwargs: passed to `torch.utils.tensorboard.SummaryWriter` (``max_queue``,
            ``flush_secs``, ...).

    Raises:
        MissingDependencyError: tensorboard is not installed.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | Path = ".",
        name: str | None = "logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        require("tensorboard", "TensorBoardLogger")
        super().__init__(save_dir, name, version)
        self._log_graph = log_graph
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else str(sub_dir)
        self._kwargs = kwargs
        self.hparams: dict[str, Any] = {}
        self._writer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    @property
    @override
    def log_dir(self) -> Path:
        """The run's directory, ``<save_dir>/<name>/<version>``, then ``<sub_dir>`` if given."""
        directory = super().log_dir
        return directory / self._sub_dir if self._sub_dir is not None else directory

    @property
    def sub_dir(self) -> str | None:
        """The directory under the version's that holds the event files, if any."""
        return self._sub_dir

    @property
    def experiment(self) -> Any:
        """The `torch.utils.tensorboard.SummaryWriter` (created on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), **self._kwargs)
        return self._writer

    @override
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, Mapping):
                self.experiment.add_scalars(key, dict(value), step)
            else:
                self.experiment.add_scalar(key, float(value), step)

    @override
    def log_hyperparams(
        self,
        params: Mapping[str, Any] | Namespace,
        metrics: Mapping[str, Any] | float | None = None,
        step: int | None = None,
    ) -> None:
        """Record ``params`` in TensorBoard's HParams view, with ``metrics`` if given.

        Args:
            params: the hyperparameters (a dict, nested dicts, or an `argparse.Namespace`).
            metrics: the metrics to show beside them (a number is ``hp_metric``).
            step: the step of those metrics.
        """
        from torch.utils.tensorboard.summary import hparams

        values = vars(params) if isinstance(params, Namespace) else dict(params)
        self.hparams.update(values)
        flat = {k: _sanitize(v) for k, v in _flatten(values).items()}
        if metrics is None:
            shown: dict[str, Any] = {"hp_metric": -1} if self._default_hp_metric else {}
        elif isinstance(metrics, Mapping):
            shown = dict(metrics)
        else:
            shown = {"hp_metric": metrics}
        if not shown:
            return
        self.log_metrics(shown, step)
        writer = self.experiment._get_file_writer()
        for summary in hparams(flat, shown):  # type: ignore[no-untyped-call]
            writer.add_summary(summary, step)

    @override
    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Write ``model``'s graph (only with ``log_graph=True``).

        Args:
            model: the model (traced with `torch.jit.trace` by TensorBoard, so an accord
                ``Module`` must be in a run).
            input_array: an input for ``model.forward``, or a tuple of its arguments
                (default: ``model.example_input_array``).
        """
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None:
            rank_zero_warn(
                "TensorBoardLogger(log_graph=True) found no input to trace the graph with: set "
                "the module's example_input_array, or call log_graph(model, input_array).",
                category=UserWarning,
            )
            return
        if not isinstance(input_array, torch.Tensor | tuple):
            rank_zero_warn(
                f"TensorBoardLogger.log_graph() got an input of type {type(input_array).__name__}"
                ", which TensorBoard cannot trace: pass a tensor, or a tuple of forward()'s "
                "arguments.",
                category=UserWarning,
            )
            return
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            self.experiment.add_graph(model, move_to_device(input_array, device))
        except ConfigurationError as err:
            # torch.jit.trace reads every attribute; a Module's `trainer` is unset outside a run.
            raise ConfigurationError(
                f"TensorBoardLogger.log_graph() could not trace {type(model).__name__}: {err} "
                "Call it during a run (in a hook such as on_fit_start), as the Trainer does "
                "with log_graph=True."
            ) from err

    @override
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @override
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _flatten(params: Mapping[Any, Any], parent: str = "") -> dict[str, Any]:
    """Nested dicts (and dataclasses, namespaces) as one level, their keys joined by ``/``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        elif isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _sanitize(value: Any) -> Any:
    """A value TensorBoard's HParams view takes: numbers, strings, booleans and tensors
    as they are, anything else as its ``str``."""
    return value if type(value) in (bool, int, float, str, torch.Tensor) else str(value)
