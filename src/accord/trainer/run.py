"""One stage (fit, validate, test or predict) on this rank: set up, run its loop, tear down.

The order is Lightning's: the module's ``configure_callbacks``, ``prepare_data`` (local
rank zero, then every rank waits), the ``setup`` hooks (datamodule, callbacks, module),
``configure_model``, the strategy's wrapping, ``configure_optimizers``, a checkpoint's
restore, then the stage's loop; the ``teardown`` hooks run also when the run fails, after
the ``on_exception`` hooks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from accord.core.strategy import RunSettings
from accord.core.wrappers.recorder import RecordingCollective, find_recorder
from accord.core.wrappers.trace_files import DEFAULT_TRACE_DIR, merge_timeline
from accord.datamodule import DataModule
from accord.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    RankFailureError,
    is_communication_error,
)
from accord.hparams import log_hyperparameters
from accord.module import Module
from accord.module_optimization import StrategyOptimizer
from accord.trainer.arguments import checkpoints_last
from accord.trainer.data import prepare_loader
from accord.trainer.evaluation_loop import (
    evaluate,
    predict,
    print_collective_stats,
    print_timeline_path,
    rank_zero_loggers,
)
from accord.trainer.fit_loop import FitLoop, train_preparer
from accord.trainer.hooks import RunHooks, check_hook_names, overridden
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import configure_optimizers
from accord.trainer.rank_loss import Survival
from accord.trainer.sources import LoaderSource, eval_source, fit_sources
from accord.trainer.state import RunState
from accord.trainer.stepping import apply_step
from accord.trainer.training_checkpoints import restore

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
    hooks and the module are set up, a checkpoint is restored when asked, the loop runs,
    and everything is torn down again, also when the run fails. With
    ``profiler="timeline"`` every rank records its collective calls and rank 0 writes
    them, merged, to ``collective-timeline-<stage>.json`` in the run's log directory;
    with a call recorder on, a failure that may come from ranks out of step leaves each
    rank's last calls in a file.
    """
    trainer.stage = stage
    state.module, state.interrupted, state.ckpt_path = model, False, None
    strategy = trainer.strategy
    strategy.configure_run(
        RunSettings(
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            manual_optimization=not model.automatic_optimization,
            sync_batchnorm=trainer.sync_batchnorm,
            on_rank_loss=trainer.on_rank_loss if stage == "fit" else "fail",
        )
    )
    recorder = _start_recording(trainer)
    model.trainer = trainer
    _attach_module_callbacks(trainer, model)
    hooks = state.hooks = RunHooks(trainer, model, trainer.callbacks, trainer.datamodule)
    check_hook_names(model, trainer.callbacks)
    state.metrics = MetricStore()
    trainer.logger_step = trainer.global_step
    strategy.report_progress(lambda: _progress(trainer, state, stage))
    try:
        _prepare_data(trainer, model)
        _setup_hooks(trainer, hooks, stage)
        if hooks.module_hook("configure_model") is not None:
            model.configure_model()
        state.wrapped = strategy.setup_module(model)
        sources: tuple[LoaderSource | None, LoaderSource | None]
        if stage == "fit":
            train_source, val_source = fit_sources(trainer, model, train_loader, eval_loader)
            _setup_fit(trainer, state, model, train_source)
            sources = (train_source, val_source)
        else:
            sources = (None, eval_source(trainer, model, stage, eval_loader))
        if ckpt_path is not None:
            restore(trainer, state, ckpt_path, stage)
        if stage == "fit" and trainer.enable_autolog_hparams:
            log_hyperparameters(rank_zero_loggers(trainer), model, trainer.datamodule)
        result = _dispatch(trainer, state, stage, sources)
        _finish_profiling(trainer, recorder, stage)
        for logger in rank_zero_loggers(trainer):
            logger.finalize("success")
        return result
    except BaseException as err:
        where = _progress(trainer, state, stage)
        failing = f"{where}, failing with {type(err).__name__}"
        strategy.report_progress(lambda: failing)
        strategy.on_exception(err)  # from here on, nothing waits for ranks that may be gone
        named = _name_lost_ranks(trainer, where, err)
        _on_failure(trainer, model, recorder, named or err)
        if named is not None:
            raise named from err
        raise
    finally:
        _teardown(trainer, hooks, recorder, stage)


def _progress(trainer: Trainer, state: RunState, stage: str) -> str:
    """What this rank is doing, as another rank's error quotes it."""
    running = state.running or stage
    if running == "train":
        return (
            f"step {trainer.global_step}, epoch {trainer.current_epoch} batch {state.batches_done}"
        )
    return f"step {trainer.global_step}, {running}"


def _name_lost_ranks(trainer: Trainer, where: str, err: BaseException) -> BaseException | None:
    """The error naming the ranks a failed wait was on (those gone, or those elsewhere),
    for a backend's raw timeout or closed connection, whether it came from a collective
    call or from a wait torch makes itself (DDP's gradient reduction); None when ``err``
    already names them or is no failed wait."""
    if isinstance(err, RankFailureError) or not is_communication_error(err):
        return None
    if isinstance(err, CollectiveTimeoutError) and err.missing_ranks:
        return None
    return trainer.strategy.diagnose(err, where)


def _on_failure(
    trainer: Trainer, model: Module, recorder: RecordingCollective | None, err: BaseException
) -> None:
    """A failing run: each rank's call trace (when it may come from ranks out of step),
    the ``on_exception`` hooks (every callback's, the datamodule's), the loggers closed."""
    trainer._state.interrupted = True
    if recorder is not None and _leaves_trace(err):
        recorder.dump_on_error(err)
    for cb in trainer.callbacks:
        cb.on_exception(trainer, model, err)
    if trainer.datamodule is not None:
        trainer.datamodule.on_exception(err)
    for logger in rank_zero_loggers(trainer):
        logger.finalize("failed")


def _teardown(
    trainer: Trainer, hooks: RunHooks, recorder: RecordingCollective | None, stage: str
) -> None:
    """The ``teardown`` hooks (datamodule, callbacks, module), then the strategy's."""
    state = trainer._state
    state.running = None
    if trainer.datamodule is not None:
        trainer.datamodule.teardown(stage=stage)
    hooks.call("teardown", stage=stage)
    state.wrapped = None
    state.prepare_train = None
    if recorder is not None:
        recorder.step_source = None
    trainer.strategy.teardown()


def _start_recording(trainer: Trainer) -> RecordingCollective | None:
    """Set the strategy's environment up with the profilers asked for; return the call
    recorder of its collective, if any, ready for this run."""
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
        torch.use_deterministic_algorithms(True, warn_only=trainer.deterministic == "warn")
    if trainer.benchmark is not None or trainer.deterministic:
        torch.backends.cudnn.benchmark = bool(trainer.benchmark) and not trainer.deterministic
    return recorder


def _attach_module_callbacks(trainer: Trainer, model: Module) -> None:
    """Add what the module's ``configure_callbacks`` returns, each replacing the Trainer's
    callbacks of its type, checkpoint callbacks last (Lightning's rule)."""
    extra = model.configure_callbacks()
    if not extra:
        return
    given = list(extra) if isinstance(extra, list | tuple) else [extra]
    kinds = {type(cb) for cb in given}
    kept = [cb for cb in trainer.callbacks if type(cb) not in kinds]
    trainer.callbacks = checkpoints_last(kept + given)


def _prepare_data(trainer: Trainer, model: Module) -> None:
    """The datamodule's and the module's ``prepare_data`` on local rank zero (global rank
    zero where ``prepare_data_per_node`` is False), then a barrier through the strategy so
    no rank reads before the data is there."""
    local_zero = trainer.local_rank == 0
    global_zero = local_zero and trainer.node_rank == 0
    owners: list[tuple[Any, type]] = [(trainer.datamodule, DataModule), (model, Module)]
    ran = False
    for owner, base in owners:
        if owner is None or not overridden(owner, base, "prepare_data"):
            continue
        per_node = getattr(owner, "prepare_data_per_node", True)
        if (per_node and local_zero) or (not per_node and global_zero):
            owner.prepare_data()
        ran = True
    if ran:
        trainer.strategy.barrier("prepare_data")


def _setup_hooks(trainer: Trainer, hooks: RunHooks, stage: str) -> None:
    """``setup(stage)``: the datamodule's, the callbacks', then the module's."""
    datamodule = trainer.datamodule
    if datamodule is not None:
        datamodule.trainer = trainer
        datamodule.setup(stage=stage)
    hooks.call("setup", stage=stage)


def _setup_fit(trainer: Trainer, state: RunState, model: Module, source: LoaderSource) -> None:
    """A fit's training loader (made on first need), optimizers and schedulers."""
    state.train_source, state.train_loader = source, None
    state.prepare_train = train_preparer(trainer, state)
    optimizers, state.schedulers = configure_optimizers(model)
    state.optimizers = trainer.strategy.setup_optimizers(state.wrapped, optimizers)  # type: ignore[arg-type]
    state.step_optimizers = [
        StrategyOptimizer(o, model, apply_step(trainer)) for o in state.optimizers
    ]
    state.survival = None
    if trainer.on_rank_loss == "continue" and trainer.strategy.world_size > 1:
        survival = Survival(trainer, state)
        survival.check_fit()
        state.survival = survival


def _finish_profiling(trainer: Trainer, recorder: RecordingCollective | None, stage: str) -> None:
    strategy = trainer.strategy
    if trainer.profiler == "collectives":
        trainer.collective_stats_by_rank = strategy.gather_collective_stats()
        print_collective_stats(trainer.collective_stats_by_rank, stage)
    if trainer.profiler == "timeline" and recorder is not None:
        gathered = recorder.gather_records()
        if gathered is not None and strategy.is_global_zero:
            target = trainer.log_dir
            path = merge_timeline(gathered, target / f"collective-timeline-{stage}.json")
            print_timeline_path(path, stage)


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
    sources: tuple[LoaderSource | None, LoaderSource | None],
) -> Any:
    """The stage's loop."""
    if stage == "fit":
        FitLoop(trainer, state, sources[1]).run()
        return None
    source = sources[1]
    assert source is not None
    loader = prepare_loader(
        source.load(),
        stage,
        trainer.strategy.distributed_sampler_kwargs,
        distributed_sampler=trainer.use_distributed_sampler,
    )
    state.eval_loaders[stage] = loader
    if stage == "validate":
        state.val_loader = loader
    if stage == "predict":
        return predict(trainer, state, loader)
    return [evaluate(trainer, state, stage, loader)]
