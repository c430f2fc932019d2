"""One stage (fit, validate, test or predict) on this rank: set up, run its loop, tear down."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from accord.core.strategy import RunSettings
from accord.core.wrappers.recorder import (
    DEFAULT_TRACE_DIR,
    RecordingCollective,
    find_recorder,
    merge_timeline,
)
from accord.datamodule import datamodule_loaders, warn_unused_val_loader
from accord.errors import CollectiveError, is_communication_error
from accord.module import Module
from accord.trainer.checkpointing import restore
from accord.trainer.data import overrides, prepare_loader
from accord.trainer.fit_loop import FitLoop
from accord.trainer.loops import (
    call_callbacks,
    evaluate,
    predict,
    print_collective_stats,
    print_timeline_path,
    rank_zero_loggers,
)
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import configure_optimizers
from accord.trainer.state import RunState

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["run_stage"]


def run_stage(
    trainer: Trainer,
    state: RunState,
    stage: str,
    model: Module,
    train_loader: Iterable[Any] | None,
    eval_loader: Iterable[Any] | None,
    ckpt_path: str | Path | None,
) -> Any:
    """Run ``stage`` on this rank and return its result.

    The strategy sets up its environment (the collective joins the other ranks), the
    module and optimizers are set up, a checkpoint is restored when asked, the loop
    runs, and the strategy is torn down again, also when the run fails. With
    ``profiler="timeline"`` every rank records its collective calls and rank 0 writes
    them, merged, to ``collective-timeline-<stage>.json`` in the run's log directory;
    with a call recorder on, a failure that may come from ranks out of step leaves each
    rank's last calls in a file.
    """
    trainer.stage = stage
    state.module = model
    strategy = trainer.strategy
    if trainer.profiler == "collectives":
        strategy.enable_collective_stats().reset()
    if trainer.profiler == "timeline":
        _record_timeline(trainer)
    strategy.setup_environment()
    rank_zero_only.rank = strategy.global_rank  # type: ignore[attr-defined]
    recorder = find_recorder(strategy.collective)
    if recorder is not None:
        # Rank 0's directory for every rank: another rank may number log versions apart.
        recorder.share_directory(_dump_dir(trainer))
        recorder.reset()
        recorder.step_source = lambda: trainer.global_step
    if trainer.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    model.trainer = trainer
    strategy.configure_run(
        RunSettings(
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            manual_optimization=not model.automatic_optimization,
        )
    )
    state.metrics = MetricStore()
    trainer.logger_step = trainer.global_step
    datamodule = trainer.datamodule
    try:
        call_callbacks(trainer, "setup", stage)
        if datamodule is not None:
            train_loader, eval_loader = datamodule_loaders(trainer, model, datamodule, stage)
        elif stage == "fit" and eval_loader is not None and not overrides(model, "validation_step"):
            warn_unused_val_loader(model)
            eval_loader = None
        model.setup(stage)
        state.wrapped = strategy.setup_module(model)
        if stage == "fit":
            optimizers, state.schedulers = configure_optimizers(model)
            state.optimizers = strategy.setup_optimizers(state.wrapped, optimizers)
        if ckpt_path is not None:
            restore(trainer, state, ckpt_path, stage)
        if stage == "fit" and model.hparams:
            for logger in rank_zero_loggers(trainer):
                logger.log_hyperparams(dict(model.hparams))
        result = _dispatch(trainer, state, stage, train_loader, eval_loader)
        if trainer.profiler == "collectives":
            trainer.collective_stats_by_rank = strategy.gather_collective_stats()
            print_collective_stats(trainer.collective_stats_by_rank, stage)
        if trainer.profiler == "timeline" and recorder is not None:
            gathered = recorder.gather_records()
            if gathered is not None and strategy.is_global_zero:
                target = trainer.log_dir
                path = merge_timeline(gathered, target / f"collective-timeline-{stage}.json")
                print_timeline_path(path, stage)
        for logger in rank_zero_loggers(trainer):
            logger.finalize("success")
        return result
    except BaseException as err:
        if recorder is not None and _leaves_trace(err):
            recorder.dump_on_error(err)
        for cb in trainer.callbacks:
            cb.on_exception(trainer, model, err)
        for logger in rank_zero_loggers(trainer):
            logger.finalize("failed")
        raise
    finally:
        model.teardown(stage)
        if datamodule is not None:
            datamodule.teardown(stage)
        call_callbacks(trainer, "teardown", stage)
        state.wrapped = None
        if recorder is not None:
            recorder.step_source = None
        strategy.teardown()


_TIMELINE_CAPACITY = 100_000
"""Calls each rank keeps for ``profiler="timeline"`` (older ones are dropped, and counted)."""


def _record_timeline(trainer: Trainer) -> None:
    """Give the strategy's collective a call recorder big enough for a timeline (or enlarge
    the one the debug check or the watchdog brought)."""
    strategy = trainer.strategy
    recorder = find_recorder(strategy.collective)
    if recorder is None:
        strategy.collective = RecordingCollective(strategy.collective, _TIMELINE_CAPACITY)
    elif recorder.capacity < _TIMELINE_CAPACITY:
        recorder.capacity = _TIMELINE_CAPACITY


def _dump_dir(trainer: Trainer) -> Path:
    """Where a failure leaves each rank's calls: the log directory, or, without a logger,
    ``accord_traces`` under ``default_root_dir`` (``ACCORD_TRACE_DIR`` wins over both)."""
    if trainer.loggers:
        return trainer.log_dir
    return trainer.default_root_dir / DEFAULT_TRACE_DIR


def _leaves_trace(error: BaseException) -> bool:
    """Whether ``error`` may come from ranks out of step (then each rank dumps its calls)."""
    return isinstance(error, (CollectiveError, KeyboardInterrupt)) or is_communication_error(error)


def _dispatch(
    trainer: Trainer,
    state: RunState,
    stage: str,
    train_loader: Iterable[Any] | None,
    eval_loader: Iterable[Any] | None,
) -> Any:
    """Each rank's share of the data, then the stage's loop."""
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs
    if stage == "fit":
        assert train_loader is not None
        train = prepare_loader(train_loader, "train", sampler_kwargs)
        val = None
        if eval_loader is not None:
            val = prepare_loader(eval_loader, "validate", sampler_kwargs)
        FitLoop(trainer, state).run(train, val)
        return None
    assert eval_loader is not None
    loader = prepare_loader(eval_loader, stage, sampler_kwargs)
    if stage == "predict":
        return predict(trainer, state, loader)
    return [evaluate(trainer, state, stage, loader)]
