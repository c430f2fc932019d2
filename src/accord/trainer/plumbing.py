"""The `Trainer`'s private plumbing: the checks of its ``__init__`` arguments, the loaders
its entry points resolve (from dataloaders, a `DataModule` or the module's hooks), the
dispatch of a run to the strategy's launcher, and the `RankZeroResults` a launched run
hands back and the launching process takes in."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accord.datamodule import DataModule, check_datamodule
from accord.errors import ConfigurationError
from accord.module import Module
from accord.trainer.arguments import check_limit, check_positive
from accord.trainer.checkpointing import checkpoint_state
from accord.trainer.data import module_loader, overrides
from accord.trainer.manual_loop import check_manual
from accord.trainer.recovery import restart_checkpoint
from accord.trainer.run import run_stage
from accord.trainer.state import RankZeroResults

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__: list[str] = []


LIMIT_NAMES = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "val_check_interval",
)
"""The `Trainer` arguments `check_limits` takes, in its order."""


def check_counts(
    accumulate_grad_batches: int, check_val_every_n_epoch: int, log_every_n_steps: int
) -> None:
    """Refuse `Trainer` counts below one.

    Raises:
        ConfigurationError: the first count out of range.
    """
    check_positive("accumulate_grad_batches", accumulate_grad_batches)
    check_positive("check_val_every_n_epoch", check_val_every_n_epoch)
    check_positive("log_every_n_steps", log_every_n_steps)


def check_bounds(max_epochs: int | None, max_steps: int, gradient_clip_val: float | None) -> None:
    """Refuse a negative ``max_epochs``, a ``max_steps`` below -1, a ``gradient_clip_val``
    not above zero.

    Raises:
        ConfigurationError: the first argument out of range.
    """
    if max_epochs is not None and max_epochs < 0:
        raise ConfigurationError(f"max_epochs={max_epochs} must be >= 0 (or None).")
    if max_steps < -1:
        raise ConfigurationError(f"max_steps={max_steps} must be -1 (no limit) or >= 0.")
    if gradient_clip_val is not None and gradient_clip_val <= 0:
        raise ConfigurationError(f"gradient_clip_val={gradient_clip_val} must be > 0.")


def check_limits(*values: int | float | None) -> None:
    """Check the `LIMIT_NAMES` arguments, given in that order, with `check_limit`."""
    for name, value in zip(LIMIT_NAMES, values, strict=True):
        check_limit(name, value)


def check_profiler(profiler: str | None) -> None:
    """Refuse a ``profiler`` other than ``"collectives"``, ``"timeline"`` or None.

    Raises:
        ConfigurationError: another value.
    """
    if profiler not in (None, "collectives", "timeline"):
        raise ConfigurationError(
            f"profiler={profiler!r} is not known; use 'collectives', 'timeline' or None."
        )


def fit_loaders(
    trainer: Trainer,
    model: Module,
    train_dataloaders: Iterable[Any] | DataModule | None,
    val_dataloaders: Iterable[Any] | None,
    datamodule: DataModule | None,
) -> tuple[Iterable[Any] | DataModule | None, Iterable[Any] | None]:
    """``Trainer.fit``'s training and validation loaders (None when ``trainer.datamodule``,
    set here, gives them on each rank); refuses a manual-optimization fit the Trainer
    cannot run, before any process starts."""
    if isinstance(train_dataloaders, DataModule):
        datamodule = check_datamodule("fit", datamodule, None, train_dataloaders)
        train_dataloaders = None
    trainer.datamodule = check_datamodule("fit", train_dataloaders, val_dataloaders, datamodule)
    if trainer.datamodule is None:
        if train_dataloaders is None:
            train_dataloaders = module_loader(model, "train_dataloader")
        if val_dataloaders is None and overrides(model, "validation_step"):
            val_dataloaders = module_loader(model, "val_dataloader", required=False)
    if isinstance(model, Module) and not model.automatic_optimization:
        # Before any process starts, so a refusal is raised here, not by every rank.
        check_manual(trainer)
    return train_dataloaders, val_dataloaders


def eval_loader(
    trainer: Trainer,
    stage: str,
    model: Module,
    dataloaders: Iterable[Any] | DataModule | None,
    datamodule: DataModule | None,
) -> Iterable[Any] | None:
    """The loader of ``stage``; None when a `DataModule` gives it on each rank."""
    if isinstance(dataloaders, DataModule):
        datamodule = check_datamodule(stage, datamodule, None, dataloaders)
        dataloaders = None
    trainer.datamodule = check_datamodule(stage, dataloaders, None, datamodule)
    if trainer.datamodule is not None:
        return None
    hook = {"validate": "val", "test": "test", "predict": "predict"}[stage]
    return dataloaders or module_loader(model, f"{hook}_dataloader")


def launch(trainer: Trainer, stage: str, model: Module, *args: Any) -> Any:
    """Run ``stage`` here or through the strategy's launcher; return its output (taking
    rank zero's results into this process when the ranks ran elsewhere)."""
    if not isinstance(model, Module):
        raise ConfigurationError(
            f"Trainer.{stage}() needs an accord.Module, got {type(model).__name__}. "
            "Subclass accord.Module (a LightningModule ports by changing its base class)."
        )
    trainer._state.module = model
    launcher = trainer.strategy.launcher
    if launcher is None:
        return trainer._run(stage, model, *args)
    if launcher.runs_in_caller:
        return launcher.launch(trainer._run, stage, model, *args)
    results: RankZeroResults | None = launcher.launch(trainer._run_rank, stage, model, *args)
    if results is None:
        return None
    trainer.apply_rank_zero_results(results)
    return results.output


def save_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """``Trainer.save_checkpoint``: the full training state through the strategy."""
    state = trainer._state
    model = state.module
    if model is None or state.wrapped is None:
        raise ConfigurationError("save_checkpoint() works during a run (fit/validate/test).")
    checkpoint = checkpoint_state(trainer, state)
    model.on_save_checkpoint(checkpoint)
    trainer.strategy.save_checkpoint(checkpoint, path)


def collect_results(trainer: Trainer, output: Any) -> RankZeroResults:
    """``Trainer.rank_zero_results``: the run's output, weights, metrics, callback states
    and counters."""
    module = trainer._state.module
    assert module is not None
    return RankZeroResults(
        output=output,
        state_dict={k: v.detach().cpu() for k, v in module.state_dict().items()},
        callback_metrics=dict(trainer.callback_metrics),
        progress_bar_metrics=dict(trainer.progress_bar_metrics),
        logged_metrics=dict(trainer.logged_metrics),
        callbacks={cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        current_epoch=trainer.current_epoch,
        global_step=trainer.global_step,
        collective_stats_by_rank=trainer.collective_stats_by_rank,
    )


def apply_results(trainer: Trainer, results: RankZeroResults) -> None:
    """``Trainer.apply_rank_zero_results``: take ``results`` into the model, the metrics,
    the callbacks and the counters."""
    state = trainer._state
    module = state.module
    if module is None:
        return
    module.load_state_dict(results.state_dict)
    metrics = state.metrics
    metrics.callback_metrics = results.callback_metrics
    metrics.progress_bar_metrics = results.progress_bar_metrics
    metrics.logged_metrics = results.logged_metrics
    for cb in trainer.callbacks:
        if cb.state_key in results.callbacks:
            cb.load_state_dict(results.callbacks[cb.state_key])
    trainer.current_epoch = results.current_epoch
    trainer.global_step = results.global_step
    trainer.collective_stats_by_rank = results.collective_stats_by_rank


def evaluate(
    trainer: Trainer,
    stage: str,
    model: Module,
    dataloaders: Iterable[Any] | DataModule | None,
    datamodule: DataModule | None,
    ckpt_path: str | Path | None,
) -> list[Any]:
    """``Trainer.validate``/``test``/``predict``: resolve the loader, launch ``stage``,
    return its output."""
    loader = eval_loader(trainer, stage, model, dataloaders, datamodule)
    result: list[Any] = launch(trainer, stage, model, None, loader, ckpt_path)
    return result


def run(
    trainer: Trainer,
    stage: str,
    model: Module,
    train_loader: Iterable[Any] | None,
    eval_loader: Iterable[Any] | None,
    ckpt_path: str | Path | None,
) -> Any:
    """``Trainer._run``: run ``stage`` in this process; a fit without ``ckpt_path`` in a
    restarted job resumes from its newest checkpoint (``auto_resume``)."""
    if stage == "fit" and ckpt_path is None:
        ckpt_path = restart_checkpoint(trainer)
    return run_stage(trainer, trainer._state, stage, model, train_loader, eval_loader, ckpt_path)


def picklable_state(trainer: Trainer) -> dict[str, Any]:
    """``Trainer.__getstate__``: its attributes, with a run state stripped of the wrapped
    model, the optimizers and the schedulers (the launching process keeps its own
    reference; children get a fresh copy)."""
    state = dataclasses.replace(trainer._state, wrapped=None, optimizers=[], schedulers=[])
    return {**trainer.__dict__, "_state": state}
