"""The evaluation and predict loops, and what every loop shares: callbacks and loggers.

The fit loop is `accord.trainer.fit_loop.FitLoop`; it runs validation through `evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from accord.callbacks.callback import Callback
from accord.loggers.logger import Logger
from accord.module import Module
from accord.trainer.data import num_batches
from accord.trainer.state import RunState

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "call_callbacks",
    "callback_hooks",
    "evaluate",
    "log_metrics",
    "module_hook",
    "predict",
    "print_collective_stats",
    "print_timeline_path",
    "rank_zero_loggers",
]


def call_callbacks(trainer: Trainer, hook: str, *args: Any) -> None:
    """Call ``hook`` on every callback, with the trainer and its module first."""
    for cb in trainer.callbacks:
        getattr(cb, hook)(trainer, trainer.model, *args)


def callback_hooks(trainer: Trainer, hook: str) -> list[Callable[..., Any]]:
    """The bound ``hook`` of every callback whose class defines its own.

    `Callback`'s hooks do nothing, so a loop that calls a hook on every batch resolves
    once which callbacks have one and calls only those (with the trainer and module first).
    """
    return [
        getattr(cb, hook)
        for cb in trainer.callbacks
        if getattr(type(cb), hook, None) is not getattr(Callback, hook) or hook in vars(cb)
    ]


def module_hook(model: Module, hook: str) -> Callable[..., Any] | None:
    """``model``'s bound ``hook``, or None where it is `Module`'s own (which does nothing)."""
    if getattr(type(model), hook, None) is getattr(Module, hook) and hook not in vars(model):
        return None
    method: Callable[..., Any] = getattr(model, hook)
    return method


def rank_zero_loggers(trainer: Trainer) -> list[Logger]:
    """The trainer's loggers on global rank zero; none on the other ranks."""
    return trainer.loggers if trainer.is_global_zero else []


def log_metrics(trainer: Trainer, metrics: Mapping[str, float]) -> None:
    """Record ``metrics`` in `Trainer.logged_metrics` and send them to the loggers."""
    if metrics:
        trainer.logged_metrics.update(metrics)
        # As Lightning's loggers see them: the epoch as a column, and the step counted
        # from 0 (optimizer steps done before the batch that logged).
        row = {**metrics, "epoch": trainer.current_epoch}
        for logger in rank_zero_loggers(trainer):
            logger.log_metrics(row, trainer.logger_step)


@rank_zero_only
def print_collective_stats(stats_by_rank: list[dict[str, dict[str, float]]], stage: str) -> None:
    """Print each rank's collective calls and their time (``profiler="collectives"``)."""
    for rank, summary in enumerate(stats_by_rank):
        calls = sum(int(row["calls"]) for row in summary.values())
        print(f"\nrank {rank}: {calls} collective calls during {stage}")
        for op, row in summary.items():
            print(
                f"  {op:<18} {int(row['calls']):>7} calls  {row['seconds']:9.4f} s  "
                f"{row['mean_ms']:8.3f} ms/call"
            )


@rank_zero_only
def print_timeline_path(path: Path, stage: str) -> None:
    """Say where ``profiler="timeline"`` wrote the merged trace of ``stage``."""
    print(
        f"\nCollective timeline of {stage} (every rank): {path}\n"
        "Open it in https://ui.perfetto.dev or chrome://tracing; "
        f"`python -m accord.trace {path} --summary` names the straggler."
    )


@torch.no_grad()
def evaluate(
    trainer: Trainer, state: RunState, stage: str, loader: Iterable[Any]
) -> dict[str, float]:
    """One validation (``stage="validate"``) or test pass; return its epoch metrics."""
    model, strategy, wrapped = state.module, trainer.strategy, state.wrapped
    assert model is not None and wrapped is not None
    validating = stage == "validate"
    hook = "validation_step" if validating else "test_step"
    trainer.num_eval_batches = num_batches(
        loader, trainer.limits["validate" if validating else "test"]
    )
    was_training = model.training
    model.eval()
    metrics = state.metrics
    metrics.stage = stage
    metrics.reset(stage)
    call_callbacks(trainer, "on_validation_start" if validating else "on_test_start")
    if validating:
        model.on_validation_epoch_start()
    else:
        model.on_test_epoch_start()
    batch_hook = "on_validation_batch_end" if validating else "on_test_batch_end"
    for batch_idx, batch in enumerate(loader):
        if batch_idx >= trainer.num_eval_batches:
            break
        batch = strategy.batch_to_device(batch)
        metrics.in_step = True
        with strategy.forward_context():
            output = strategy.step(wrapped, hook, batch, batch_idx)
        metrics.in_step = False
        metrics.flush_step(strategy)
        call_callbacks(trainer, batch_hook, output, batch, batch_idx)
    if validating:
        model.on_validation_epoch_end()
    else:
        model.on_test_epoch_end()
    results = metrics.flush_epoch(strategy, stage)
    log_metrics(trainer, results)
    if validating:
        call_callbacks(trainer, "on_validation_end")
    model.train(was_training)
    return results


@torch.no_grad()
def predict(trainer: Trainer, state: RunState, loader: Iterable[Any]) -> list[Any]:
    """Return ``predict_step``'s output for every batch of ``loader``."""
    model, strategy, wrapped = state.module, trainer.strategy, state.wrapped
    assert model is not None and wrapped is not None
    trainer.num_eval_batches = num_batches(loader, trainer.limits["predict"])
    model.eval()
    state.metrics.stage = "predict"
    call_callbacks(trainer, "on_predict_start")
    outputs = []
    for batch_idx, batch in enumerate(loader):
        if batch_idx >= trainer.num_eval_batches:
            break
        batch = strategy.batch_to_device(batch)
        with strategy.forward_context():
            output = strategy.step(wrapped, "predict_step", batch, batch_idx)
        outputs.append(output)
        call_callbacks(trainer, "on_predict_batch_end", output, batch, batch_idx)
    return outputs
