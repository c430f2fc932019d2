"""Automatic recovery: a restarted job resumes from its newest finished checkpoint by itself."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from accord.errors import CheckpointError
from accord.trainer.checkpoint_paths import resolve_ckpt_path

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["restart_checkpoint"]

_log = logging.getLogger(__name__)


def restart_checkpoint(trainer: Trainer) -> Path | None:
    """The checkpoint a restarted job resumes from, or None to start afresh.

    None unless ``trainer.auto_resume`` is on and the cluster environment says the job was
    restarted (`ClusterEnvironment.restart_count` > 0). Then it is the newest finished
    checkpoint, as ``ckpt_path="last"`` finds it; global rank zero says which (or that
    there is none, so the run starts from the beginning). Every rank must see the same
    checkpoint directory (a shared filesystem on several machines).
    """
    environment = trainer.strategy.cluster_environment
    if not trainer.auto_resume or environment is None:
        return None
    restarts = environment.restart_count()
    if restarts <= 0:
        return None
    rank_zero = environment.global_rank() == 0
    try:
        path = resolve_ckpt_path(trainer, "last")
    except CheckpointError:
        if rank_zero:
            _log.info(
                "restart %d: no finished checkpoint yet, so training starts afresh.", restarts
            )
        return None
    if rank_zero:
        _log.info(
            "restart %d: resuming from %r, the newest finished checkpoint "
            "(Trainer(auto_resume=False) turns this off).",
            restarts,
            str(path),
        )
    return path
