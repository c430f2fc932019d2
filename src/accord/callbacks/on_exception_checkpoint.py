"""`OnExceptionCheckpoint`: save a checkpoint when a run fails, without waiting for other ranks."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_utilities.core.rank_zero import rank_prefixed_message
from typing_extensions import override

from accord.callbacks.checkpoint import Checkpoint
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.core.strategy import Strategy
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["OnExceptionCheckpoint"]

_STATE_METHODS = ("module_state_dict", "optimizer_state_dict", "save_checkpoint")


class OnExceptionCheckpoint(Checkpoint):
    """Save a checkpoint to ``<dirpath>/<filename>.ckpt`` when a run raises, as Lightning's.

    A run that ends without an exception removes that file in its ``teardown`` (so one
    left from an earlier failure is gone once a resumed run ends well), as in Lightning.

    When one rank raises, the others may be anywhere (inside a collective, waiting for
    it), so the save never waits for them:

    - one process (``world_size == 1``): ``trainer.save_checkpoint``, as Lightning does;
    - several ranks, with a strategy whose every rank holds the whole model and
      optimizer state (the DDP family, Horovod): each rank that reaches
      ``on_exception`` writes its own state to the file itself, atomically, with no
      collective call. Ranks that fail together each write a complete checkpoint and the
      last one stays; the ranks' model and optimizer states are the same;
    - several ranks with a strategy that shards the state (FSDP, DeepSpeed) or writes
      through its own collective (XLA): a checkpoint needs every rank, which cannot be
      relied on after an exception, so nothing is saved and a warning says so. Save
      regularly with ``ModelCheckpoint(every_n_train_steps=...)`` there.

    A failure of the save itself is a warning: the run's own exception goes on. An
    ``on_save_checkpoint`` hook that communicates between ranks cannot run safely here.

    Args:
        dirpath: the directory to write to.
        filename: the file's name, without ``.ckpt``.

    Raises:
        ConfigurationError: an empty ``filename``.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | Path, filename: str = "on_exception") -> None:
        if not filename:
            raise ConfigurationError(
                "OnExceptionCheckpoint(filename='') needs a file name (without .ckpt)."
            )
        self.dirpath = dirpath
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        """Where the checkpoint goes."""
        return str(Path(self.dirpath) / f"{self.filename}{self.FILE_EXTENSION}")

    @override
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        from accord.trainer.training_checkpoints import save_checkpoint

        strategy = trainer.strategy
        several = strategy.world_size > 1
        rank = strategy.global_rank if several else None
        if trainer.model_wrapper is None:
            _warn(
                rank,
                "OnExceptionCheckpoint saved nothing: the run failed before its model was set up.",
            )
            return
        if several and not _holds_whole_state(type(strategy)):
            _warn(
                rank,
                f"OnExceptionCheckpoint saved nothing: {type(strategy).__name__} needs every "
                "rank to write a checkpoint, and after an exception the other ranks cannot "
                "be relied on to take part. Save regularly with "
                "ModelCheckpoint(every_n_train_steps=...) instead.",
            )
            return
        try:
            save_checkpoint(trainer, self.ckpt_path, rank_local=several)
        except Exception as err:  # the run's own exception matters more than this one
            _warn(rank, f"OnExceptionCheckpoint could not save to {self.ckpt_path!r}: {err}")

    @override
    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None:
        # accord runs teardown after a failure too; Lightning only after a run that ended
        # well, and only then is the file removed.
        if not trainer.interrupted:
            trainer.strategy.remove_checkpoint(self.ckpt_path)


def _holds_whole_state(kind: type[Strategy]) -> bool:
    """Whether every rank of a ``kind`` strategy holds the whole state and reads it without
    a collective: it keeps the default checkpoint methods."""
    from accord.core.strategy_checkpoints import StrategyCheckpointing

    return all(
        getattr(kind, name) is getattr(StrategyCheckpointing, name) for name in _STATE_METHODS
    )


def _warn(rank: int | None, message: str) -> None:
    # Every rank says it: the rank that failed may not be rank zero.
    warnings.warn(rank_prefixed_message(message, rank), RuntimeWarning, stacklevel=3)
