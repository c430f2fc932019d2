"""`Logger`: where metrics go. The Trainer calls loggers on global rank zero only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import override

if TYPE_CHECKING:
    import torch

    from accord.callbacks.model_checkpoint import ModelCheckpoint

__all__ = ["Logger", "add_prefix", "next_version", "version_directory"]

V = TypeVar("V")


class Logger(ABC):
    """Base class of the loggers, with the interface of Lightning's ``Logger``.

    A logger that writes files keeps each run in ``<save_dir>/<name>/<version>``
    (`log_dir`): the version is ``version_<n>``, ``n`` the next free number unless one was
    given, or the string given. The default `ModelCheckpoint` writes beside the logs, in
    ``<log_dir>/checkpoints``.

    A logger written for Lightning ports by changing its base class: override `name` and
    `version` as properties (and `save_dir` if it writes files), `log_metrics`, and
    `log_hyperparams`; the rest has defaults. Without a `save_dir` (the default of this
    base class, as in Lightning) the default checkpoint directory is under the Trainer's
    ``default_root_dir``.

    Args:
        save_dir: the root directory (None: the logger writes no files of its own).
        name: the experiment's sub-directory (``""`` or None: none, versions go straight
            into ``save_dir``).
        version: the run's number or directory name (default: the next free number,
            chosen on first use).
    """

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = "logs",
        version: int | str | None = None,
    ) -> None:
        self._save_dir = Path(save_dir).expanduser() if save_dir is not None else None
        self._name = name or ""
        self._version: int | str | None = version
        self._version_given = version is not None

    @property
    def save_dir(self) -> Path | None:
        """The root directory all experiments are under (None: no local files)."""
        return _attribute(self, "_save_dir", None)

    @property
    def name(self) -> str:
        """The experiment's name: the sub-directory of `save_dir` its versions are in."""
        return _attribute(self, "_name", "")

    @property
    def version(self) -> int | str:
        """The run's number (an int), or its directory name (a str)."""
        version: int | str | None = _attribute(self, "_version", None)
        if version is None:
            root = self.root_dir
            version = next_version(root) if root is not None else 0
            self._version = version
        return version

    @property
    def auto_version(self) -> bool:
        """Whether the version is the next free number, chosen by the logger (no version
        was given). The default checkpoint directory of a restarted run is then a new
        one, and ``ckpt_path="last"`` looks in the experiment's earlier versions too."""
        return not _attribute(self, "_version_given", True)

    @property
    def root_dir(self) -> Path | None:
        """``<save_dir>/<name>``: where every version of the experiment is (None without a
        `save_dir`)."""
        save_dir = self.save_dir
        return Path(save_dir) / self.name if save_dir is not None else None

    @property
    def log_dir(self) -> Path:
        """The directory this run writes to: ``<save_dir>/<name>/<version>`` (relative to
        the working directory without a `save_dir`)."""
        return (self.root_dir or Path(self.name)) / version_directory(self.version)

    @property
    def group_separator(self) -> str:
        """The separator that groups metric names (``"train/loss"``), as in Lightning."""
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record ``metrics`` at optimizer step ``step``."""

    def log_hyperparams(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters."""

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Record the model's graph (only `TensorBoardLogger` does; the others do nothing).

        Args:
            model: the model.
            input_array: an input for ``model.forward`` (default: the model's
                ``example_input_array``).
        """

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """Called on global rank zero by `ModelCheckpoint` after each checkpoint it writes.

        Args:
            checkpoint_callback: the callback; its ``last_model_path``,
                ``best_model_path`` and ``best_k_models`` name what is on disk.
        """

    def save(self) -> None:
        """Flush what is buffered to disk."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` (``"success"`` or ``"failed"``); close files."""
        self.save()


class _DirectoryLogger(Logger):
    """A logger that always writes files: its `save_dir` is set (its ``__init__`` passes
    one to `Logger`'s)."""

    @property
    @override
    def save_dir(self) -> Path:
        """The root directory all experiments are under."""
        assert self._save_dir is not None
        return self._save_dir

    @property
    @override
    def root_dir(self) -> Path:
        """``<save_dir>/<name>``."""
        return self.save_dir / self.name


def _attribute(logger: Logger, name: str, default: V) -> V:
    # A subclass written for Lightning may not call Logger.__init__.
    value: V = logger.__dict__.get(name, default)
    return value


def version_directory(version: int | str) -> str:
    """The directory name of ``version``: a string as it is, a number as ``version_<n>``."""
    return version if isinstance(version, str) else f"version_{version}"


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


def add_prefix(metrics: Mapping[str, V], prefix: str, separator: str = "-") -> dict[str, V]:
    """``metrics`` with each name as ``<prefix><separator><name>`` (unchanged without a
    prefix), as a logger's ``prefix=`` argument asks."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}
