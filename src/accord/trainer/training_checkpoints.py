"""The Trainer's checkpoints: the full training state saved, and restored.

A checkpoint records the loop's position mid-epoch as well as at epoch ends, so a resumed
fit continues with the batch, the shuffled order and the LR it would have had. The format,
its atomic writes and safe reads are `accord.checkpoint`'s; the strategy writes and reads
the files (`accord.core.strategy_checkpoints`, overridden by the engines that shard). Which
file a ``ckpt_path`` names is `accord.trainer.checkpoint_paths`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from accord.checkpoint.compiled_names import plain_names
from accord.checkpoint.formats import CHECKPOINT_FORMAT_VERSION
from accord.checkpoint.writing import save_checkpoint_file
from accord.datamodule import DataModule
from accord.errors import CheckpointError, ConfigurationError
from accord.trainer.checkpoint_paths import last_everywhere, resolve_ckpt_path
from accord.trainer.data import epoch_order, resume_loader, samples_per_batch
from accord.trainer.optimizers import due_schedulers, step_schedulers
from accord.trainer.state import RunState

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "adopt_state",
    "checkpoint_state",
    "epoch_batches",
    "restore",
    "save_checkpoint",
]


def save_checkpoint(
    trainer: Trainer, path: str | Path, *, weights_only: bool = False, rank_local: bool = False
) -> None:
    """Write the run's checkpoint to ``path`` through the strategy (every rank must call it),
    with the callbacks' (not for weights only) and the module's ``on_save_checkpoint``
    hooks, as Lightning calls them.

    With ``weights_only`` it holds the weights and what ``load_from_checkpoint`` needs
    only (`checkpoint_state`), as Lightning's ``save_checkpoint(path, weights_only=True)``.
    With ``rank_local`` this rank writes its own state to ``path`` itself, atomically,
    and no other rank takes part: only for a strategy whose every rank holds the whole
    state and whose state dicts need no collective (the default checkpoint methods).

    Raises:
        ConfigurationError: outside a run.
        CheckpointError: on every rank, when the strategy could not write the checkpoint;
            the message names the earlier checkpoints of the `ModelCheckpoint` callbacks
            that are still on disk.
    """
    state = trainer._state
    model = state.module
    if model is None or state.wrapped is None:
        raise ConfigurationError("save_checkpoint() works during a run (fit/validate/test).")
    checkpoint = checkpoint_state(trainer, state, weights_only=weights_only)
    hooks = state.hooks
    if hooks is not None and not weights_only:
        for hook in hooks.callback_hooks("on_save_checkpoint"):
            hook(checkpoint)
    model.on_save_checkpoint(checkpoint)
    if rank_local:
        save_checkpoint_file(checkpoint, path)
        return
    try:
        trainer.strategy.save_checkpoint(checkpoint, path)
    except CheckpointError as err:
        kept = _kept_checkpoints(trainer, path)
        if not kept:
            raise
        names = ", ".join(map(repr, kept))
        still = (
            f"The earlier checkpoint {names} is still there; fit(ckpt_path=...) resumes from it."
            if len(kept) == 1
            else f"The earlier checkpoints {names} are still there; fit(ckpt_path=...) "
            "resumes from any of them."
        )
        raise CheckpointError(f"{err} {still}") from err


def _kept_checkpoints(trainer: Trainer, path: str | Path) -> list[str]:
    """The best and last checkpoints of the `ModelCheckpoint` callbacks that are on disk,
    other than ``path``."""
    target = Path(path).absolute()
    kept: list[str] = []
    for callback in trainer.checkpoint_callbacks:
        for saved in (callback.best_model_path, callback.last_model_path):
            other = saved and saved not in kept and Path(saved).absolute() != target
            if other and Path(saved).exists():
                kept.append(saved)
    return kept


def checkpoint_state(
    trainer: Trainer, state: RunState, *, weights_only: bool = False
) -> dict[str, Any]:
    """The full training state of the run in progress, as a checkpoint dict.

    With ``weights_only``, only the weights and what ``load_from_checkpoint`` needs
    (the weights, the hyperparameters, the position), marked ``"weights_only": True``: such a checkpoint cannot
    resume a fit.
    """
    if not weights_only:
        return _full_state(trainer, state)
    strategy = trainer.strategy
    assert state.wrapped is not None
    return {
        **_what_and_where(trainer),
        "state_dict": plain_names(strategy.module_state_dict(state.wrapped)),
        "hyper_parameters": (
            state.module.hparams_for_checkpoint() if state.module is not None else {}
        ),
        **_datamodule_hparams(trainer.datamodule),
        "weights_only": True,
    }


def _what_and_where(trainer: Trainer) -> dict[str, Any]:
    """What every checkpoint says about itself: its format version, the strategy and world
    size that wrote it, and the loop's epoch and step."""
    strategy = trainer.strategy
    return {
        "accord_checkpoint_version": CHECKPOINT_FORMAT_VERSION,
        "strategy": type(strategy).__name__,
        "world_size": strategy.world_size,
        # The engines that write sharded directories set it on what they write.
        "sharded": False,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def _full_state(trainer: Trainer, state: RunState) -> dict[str, Any]:
    strategy = trainer.strategy
    assert state.wrapped is not None
    epoch_finished = state.batches_done >= trainer.num_training_batches
    monitors = {c.monitor for c in state.schedulers if c.monitor is not None}
    consumed = state.samples_consumed()
    datamodule = trainer.datamodule
    return {
        **_what_and_where(trainer),
        "batches_done": state.batches_done,
        "samples_consumed": consumed,
        "data_order": state.epoch_order,
        "epoch_finished": epoch_finished,
        # Saved after the epoch's last batch but before some of its epoch schedulers
        # stepped (the monitored ones step after on_train_epoch_end): the resume steps
        # them, with the values they monitor now.
        "epoch_schedulers_pending": _pending_schedulers(trainer, state) if epoch_finished else [],
        "scheduler_monitors": {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name in monitors
        },
        # Plain names, whatever torch.compile wrapped: any model, compiled or not, loads them.
        "state_dict": plain_names(strategy.module_state_dict(state.wrapped)),
        "optimizer_states": [strategy.optimizer_state_dict(o) for o in state.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in state.schedulers],
        "precision": strategy.precision_state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "hyper_parameters": (
            state.module.hparams_for_checkpoint() if state.module is not None else {}
        ),
        "datamodule": datamodule.state_dict() if datamodule is not None else {},
        **_datamodule_hparams(datamodule),
        "rng_epoch_start": state.rng_epoch_start,
        "rng": torch.get_rng_state(),
    }


def adopt_state(trainer: Trainer, state: RunState, checkpoint: dict[str, Any]) -> None:
    """Take another rank's training state (`checkpoint_state` there) as this rank's own,
    in the middle of a fit: weights, optimizers, schedulers, precision, callbacks, the
    datamodule's state, the counters, the position in the epoch and the RNG. No hook runs:
    this is the same run, caught up, not a checkpoint loaded."""
    strategy = trainer.strategy
    assert state.wrapped is not None
    strategy.load_module_state_dict(state.wrapped, checkpoint["state_dict"], True)
    for optimizer, optimizer_state in zip(
        state.optimizers, checkpoint["optimizer_states"], strict=True
    ):
        strategy.load_optimizer_state_dict(optimizer, optimizer_state)
    for config, scheduler_state in zip(state.schedulers, checkpoint["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler_state)
    strategy.load_precision_state_dict(checkpoint.get("precision", {}))
    for cb in trainer.callbacks:
        if cb.state_key in checkpoint["callbacks"]:
            cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
    if trainer.datamodule is not None:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])
    trainer.global_step = int(checkpoint["global_step"])
    trainer.current_epoch = int(checkpoint["epoch"])
    state.batches_done = int(checkpoint["batches_done"])
    torch.set_rng_state(checkpoint["rng"])


def _pending_schedulers(trainer: Trainer, state: RunState) -> list[int]:
    """The indices of the epoch-interval schedulers due at this epoch's end that have not
    stepped yet."""
    due = due_schedulers(state.schedulers, "epoch", trainer.current_epoch + 1, None)
    return [
        index
        for index, config in enumerate(state.schedulers)
        if config in due and id(config) not in state.epoch_schedulers_stepped
    ]


def _datamodule_hparams(datamodule: DataModule | None) -> dict[str, Any]:
    """The datamodule's hyperparameters under Lightning's key (nothing when it has none)."""
    if datamodule is None or not datamodule.hparams:
        return {}
    return {DataModule.CHECKPOINT_HYPER_PARAMS_KEY: datamodule.hparams_for_checkpoint()}


def restore(trainer: Trainer, state: RunState, ckpt_path: str | Path, stage: str) -> None:
    """Load the checkpoint at ``ckpt_path`` into the run being set up.

    In Lightning's order: the module's ``on_load_checkpoint`` (it may change the checkpoint
    first), its weights (``strict`` as the module's ``strict_loading``), the callbacks'
    ``on_load_checkpoint``. Outside ``fit`` that is all; a fit also gets the optimizers,
    schedulers, precision, callback states and the loop's position back.

    Raises:
        CheckpointError: not an accord checkpoint, one that does not fit this run, or a
            weights-only checkpoint given to ``fit``.
    """
    model, wrapped, strategy = state.module, state.wrapped, trainer.strategy
    assert model is not None and wrapped is not None
    if str(ckpt_path) == "last":
        # Every rank loads rank zero's choice (the newest file, by its clock and disk).
        path = last_everywhere(trainer, stage)
    else:
        path = resolve_ckpt_path(trainer, ckpt_path, stage)
    checkpoint = strategy.load_checkpoint(path)
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{str(path)!r} is not an accord checkpoint (no 'state_dict').")
    if stage == "fit" and checkpoint.get("weights_only"):
        raise CheckpointError(
            f"{str(path)!r} holds weights only (save_checkpoint(weights_only=True) or "
            "ModelCheckpoint(save_weights_only=True)), so it cannot resume a fit: it has no "
            "optimizer, scheduler or loop state. Load its weights with "
            "load_from_checkpoint(path) and start a new fit, or resume from a checkpoint "
            "saved without weights_only."
        )
    state.ckpt_path = str(path)
    model.on_load_checkpoint(checkpoint)
    try:
        strategy.load_module_state_dict(wrapped, checkpoint["state_dict"], model.strict_loading)
    except RuntimeError as err:
        raise CheckpointError(
            f"{str(path)!r} does not fit {type(model).__name__}: it was saved from a "
            f"different model or configuration.\n{err}"
        ) from err
    hooks = state.hooks
    if hooks is not None:
        for hook in hooks.callback_hooks("on_load_checkpoint"):
            hook(checkpoint)
    if stage == "fit":
        _restore_training(trainer, state, checkpoint, path)


def _restore_training(
    trainer: Trainer, state: RunState, checkpoint: dict[str, Any], path: Path
) -> None:
    """The optimizers, schedulers, precision, callbacks, datamodule and position."""
    strategy = trainer.strategy
    states = checkpoint.get("optimizer_states", [])
    if len(states) != len(state.optimizers):
        # A reader that could not bring the optimizer state along says why and what to do.
        missing = checkpoint.get("optimizer_states_missing")
        raise CheckpointError(
            f"{str(path)!r} holds {len(states)} optimizer state(s) but "
            f"configure_optimizers() returned {len(state.optimizers)}."
            + (f" {missing}" if missing else "")
        )
    for optimizer, optimizer_state in zip(state.optimizers, states, strict=True):
        strategy.load_optimizer_state_dict(optimizer, optimizer_state)
    for config, scheduler_state in zip(
        state.schedulers, checkpoint.get("lr_schedulers", []), strict=False
    ):
        config.scheduler.load_state_dict(scheduler_state)
    finished = bool(checkpoint.get("epoch_finished", True))
    pending = checkpoint.get("epoch_schedulers_pending", [])
    if finished and pending:
        # An older checkpoint says True: every epoch scheduler was still to step.
        chosen = (
            state.schedulers
            if pending is True
            else [state.schedulers[i] for i in pending if i < len(state.schedulers)]
        )
        step_schedulers(
            chosen, "epoch", int(checkpoint["epoch"]) + 1, checkpoint.get("scheduler_monitors", {})
        )
    strategy.load_precision_state_dict(checkpoint.get("precision", {}))
    for cb in trainer.callbacks:
        if cb.state_key in checkpoint.get("callbacks", {}):
            cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
    if trainer.datamodule is not None and "datamodule" in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])
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
        order, consumed = checkpoint.get("data_order"), checkpoint.get("samples_consumed")
        if isinstance(order, dict) and isinstance(consumed, int):
            state.resume_position = (order, consumed)
        elif checkpoint.get("world_size", trainer.world_size) != trainer.world_size:
            rank_zero_warn(
                f"This checkpoint was saved mid-epoch on {checkpoint['world_size']} rank(s) "
                "with a data order accord cannot rebuild (an IterableDataset, a custom "
                f"sampler, or a loader with its own generator); on {trainer.world_size} the "
                "rest of the epoch skips the batches done, which may repeat or skip samples. "
                "Resume on the same world size, or from a checkpoint saved at an epoch's end.",
                category=UserWarning,
            )
    state.batches_done = state.skip_batches


def epoch_batches(
    trainer: Trainer, state: RunState, loader: Iterable[Any]
) -> tuple[Iterator[Any], int]:
    """This rank's batches of the epoch that starts, and the index of the first one.

    After a mid-epoch resume the epoch continues with the positions of the checkpoint's
    global order that no rank had consumed, dealt over this run's ranks (whatever their
    number and batch size); an order accord cannot reproduce is resumed by skipping the
    batches done, which is exact only on the world size that saved it. Records the epoch's
    order in ``state`` for the next checkpoint.
    """
    kwargs = trainer.strategy.distributed_sampler_kwargs
    replicas, rank = (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)
    resume, state.resume_position = state.resume_position, None
    skip, state.skip_batches = state.skip_batches, 0
    state.samples_per_batch = samples_per_batch(loader, replicas)
    state.epoch_order = epoch_order(loader, state.rng_epoch_start)
    state.epoch_samples_start = state.epoch_batch_start = 0
    if resume is not None and state.samples_per_batch and isinstance(loader, DataLoader):
        order, consumed = resume
        start = consumed // state.samples_per_batch
        state.epoch_order, state.epoch_samples_start = order, consumed
        state.epoch_batch_start = state.batches_done = start
        return iter(resume_loader(loader, order, consumed, replicas, rank)), start
    survival = state.survival
    if survival is not None and survival.changes:
        # The group lost ranks earlier in the fit: the epoch keeps its global batch.
        return survival.batches(loader, skip), skip
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator, None)
    return iterator, skip
