"""Which checkpoint a ``ckpt_path`` names: a path, ``"last"`` (the newest finished one
where the `ModelCheckpoint` callbacks look, as rank zero finds it) or ``"best"``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.checkpoint.formats import finished_checkpoints, is_finished_checkpoint
from accord.errors import CheckpointError
from accord.trainer.preemption import PREEMPTION_CHECKPOINT_NAME

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["last_everywhere", "resolve_ckpt_path"]


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | Path, stage: str = "fit") -> Path:
    """The checkpoint ``ckpt_path`` names: a path, ``"last"`` or ``"best"``.

    ``"last"`` is the newest finished checkpoint where the `ModelCheckpoint` callbacks
    look (`ModelCheckpoint.checkpoint_dirs`: their ``dirpath``, or by default the log
    version's ``checkpoints`` and, for a logger that numbers its versions, those of the
    experiment's earlier versions; ``<default_root_dir>/checkpoints`` without a
    `ModelCheckpoint`); for ``stage="fit"`` the files of a callback with
    ``save_weights_only`` are passed over (they cannot resume a fit), all but a preemption
    checkpoint in its directory. ``"best"`` is the first `ModelCheckpoint`'s
    ``best_model_path``.

    Raises:
        CheckpointError: ``"last"`` but there is no finished checkpoint; ``"best"`` but
            there is no `ModelCheckpoint`, or it has saved nothing yet.
    """
    if str(ckpt_path) == "best":
        return _best(trainer)
    if str(ckpt_path) != "last":
        return Path(ckpt_path)
    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    if callbacks:
        directories = [d for c in callbacks for d in c.checkpoint_dirs(trainer)]
        candidates = []
        for callback in callbacks:
            if stage == "fit" and callback.save_weights_only:
                # Its files cannot resume a fit; a preemption checkpoint beside them can.
                found = (d / PREEMPTION_CHECKPOINT_NAME for d in callback.checkpoint_dirs(trainer))
                candidates += [path for path in found if is_finished_checkpoint(path)]
            else:
                candidates += callback.find_checkpoints(trainer)
    else:
        directories = [Path(trainer.default_root_dir) / "checkpoints"]
        candidates = finished_checkpoints(directories, ModelCheckpoint.FILE_EXTENSION, 0)
    if not candidates:
        where = ", ".join(repr(str(d)) for d in dict.fromkeys(directories))
        raise CheckpointError(
            f"ckpt_path='last' but there is no checkpoint in {where}. Train first, or pass "
            "the path of a checkpoint."
        )
    return max(candidates, key=lambda p: p.stat().st_mtime)


def last_everywhere(trainer: Trainer, stage: str) -> Path:
    """``ckpt_path="last"`` as rank zero resolves it, on every rank (or its error)."""
    found: tuple[str | None, str | None] = (None, None)
    if trainer.is_global_zero:
        try:
            found = (str(resolve_ckpt_path(trainer, "last", stage)), None)
        except CheckpointError as err:
            found = (None, str(err))
    path, error = trainer.strategy.broadcast(found, src=0)
    if error is not None or path is None:
        raise CheckpointError(error or "ckpt_path='last' found no checkpoint.")
    return Path(path)


def _best(trainer: Trainer) -> Path:
    callback = trainer.checkpoint_callback
    if callback is None:
        raise CheckpointError(
            "ckpt_path='best' needs a ModelCheckpoint callback, and this Trainer has none "
            "(enable_checkpointing=False?). Add ModelCheckpoint(monitor=...) to callbacks, or "
            "pass the path of a checkpoint."
        )
    if not callback.best_model_path:
        raise CheckpointError(
            "ckpt_path='best' but the ModelCheckpoint has no best checkpoint yet: it is set "
            "when this Trainer's fit saves one (a new Trainer does not know an earlier run's). "
            "Fit first with this Trainer, or pass the path of a checkpoint."
        )
    return Path(callback.best_model_path)
