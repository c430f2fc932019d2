"""The Trainer's checkpoints: the full training state saved, found again, and restored.

A checkpoint records the loop's position mid-epoch as well as at epoch ends, so a resumed
fit continues with the batch, the shuffled order and the LR it would have had.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accord.errors import CheckpointError
from accord.trainer.optimizers import step_schedulers
from accord.trainer.state import RunState

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["CHECKPOINT_VERSION", "checkpoint_state", "resolve_ckpt_path", "restore"]

CHECKPOINT_VERSION = 1
"""The layout version written as ``accord_checkpoint_version``."""


def checkpoint_state(trainer: Trainer, state: RunState) -> dict[str, Any]:
    """The full training state of the run in progress, as a checkpoint dict."""
    strategy = trainer.strategy
    assert state.wrapped is not None
    epoch_finished = state.batches_done >= trainer.num_training_batches
    monitors = {c.monitor for c in state.schedulers if c.monitor is not None}
    return {
        "accord_checkpoint_version": CHECKPOINT_VERSION,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "batches_done": state.batches_done,
        "epoch_finished": epoch_finished,
        # Saved after the epoch's last batch but before its schedulers stepped (a save
        # after validation): the resume steps them, with the values they monitor now.
        "epoch_schedulers_pending": epoch_finished and not state.epoch_schedulers_stepped,
        "scheduler_monitors": {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name in monitors
        },
        "state_dict": strategy.module_state_dict(state.wrapped),
        "optimizer_states": [strategy.optimizer_state_dict(o) for o in state.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in state.schedulers],
        "precision": strategy.precision_state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "rng_epoch_start": state.rng_epoch_start,
        "rng": torch.get_rng_state(),
    }


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | Path) -> Path:
    """``ckpt_path`` itself, or for ``"last"`` the newest checkpoint where they are saved.

    Raises:
        CheckpointError: ``"last"`` but there is no checkpoint.
    """
    if str(ckpt_path) != "last":
        return Path(ckpt_path)
    callback = trainer.checkpoint_callback
    directory = (
        callback.dirpath
        if callback is not None and callback.dirpath is not None
        else trainer.default_root_dir / "checkpoints"
    )
    candidates = sorted(Path(directory).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise CheckpointError(
            f"ckpt_path='last' but there is no checkpoint in {str(directory)!r}. Train "
            "first, or pass the path of a checkpoint."
        )
    return candidates[-1]


def restore(trainer: Trainer, state: RunState, ckpt_path: str | Path, stage: str) -> None:
    """Load the checkpoint at ``ckpt_path`` into the run being set up.

    Outside ``fit`` only the module's weights (and its ``on_load_checkpoint``) are
    restored; a fit also gets the optimizers, schedulers, precision, callbacks and the
    loop's position back.

    Raises:
        CheckpointError: not an accord checkpoint, or one that does not fit this run.
    """
    model, wrapped, strategy = state.module, state.wrapped, trainer.strategy
    assert model is not None and wrapped is not None
    path = resolve_ckpt_path(trainer, ckpt_path)
    checkpoint = strategy.load_checkpoint(path)
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{str(path)!r} is not an accord checkpoint (no 'state_dict').")
    try:
        strategy.load_module_state_dict(wrapped, checkpoint["state_dict"])
    except RuntimeError as err:
        raise CheckpointError(
            f"{str(path)!r} does not fit {type(model).__name__}: it was saved from a "
            f"different model or configuration.\n{err}"
        ) from err
    model.on_load_checkpoint(checkpoint)
    if stage != "fit":
        return
    states = checkpoint.get("optimizer_states", [])
    if len(states) != len(state.optimizers):
        raise CheckpointError(
            f"{str(path)!r} holds {len(states)} optimizer state(s) but "
            f"configure_optimizers() returned {len(state.optimizers)}."
        )
    for optimizer, optimizer_state in zip(state.optimizers, states, strict=True):
        strategy.load_optimizer_state_dict(optimizer, optimizer_state)
    for config, scheduler_state in zip(
        state.schedulers, checkpoint.get("lr_schedulers", []), strict=False
    ):
        config.scheduler.load_state_dict(scheduler_state)
    finished = bool(checkpoint.get("epoch_finished", True))
    if finished and checkpoint.get("epoch_schedulers_pending", False):
        step_schedulers(
            state.schedulers,
            "epoch",
            int(checkpoint["epoch"]) + 1,
            checkpoint.get("scheduler_monitors", {}),
        )
    strategy.load_precision_state_dict(checkpoint.get("precision", {}))
    for cb in trainer.callbacks:
        if cb.state_key in checkpoint.get("callbacks", {}):
            cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
    trainer.global_step = int(checkpoint["global_step"])
    _restore_position(trainer, state, checkpoint, finished)


def _restore_position(
    trainer: Trainer, state: RunState, checkpoint: dict[str, Any], finished: bool
) -> None:
    """Put the fit loop where the checkpoint was: the next epoch, or mid-epoch."""
    epoch = int(checkpoint["epoch"])
    has_rng = "rng" in checkpoint
    if finished:
        trainer.current_epoch = epoch + 1
        state.skip_batches = 0
        state.resume_rng = (None, checkpoint["rng"]) if has_rng else None
    else:
        trainer.current_epoch = epoch
        state.skip_batches = int(checkpoint["batches_done"])
        start = checkpoint.get("rng_epoch_start")
        state.resume_rng = (start, checkpoint["rng"]) if has_rng else None
    state.batches_done = state.skip_batches
