"""The validation, test and predict loops (the sanity check is a short validation), and
what every loop shares: the loggers and the metrics they get.

The fit loop (`accord.trainer.fit_loop`) runs validation through `evaluate`. Hooks run in
Lightning's order, callbacks before the module: ``on_<stage>_model_eval``,
``on_<stage>_start``, ``on_<stage>_epoch_start``, per batch ``on_<stage>_batch_start``,
the step, ``on_<stage>_batch_end``; then the epoch's metrics are synced,
``on_<stage>_epoch_end`` runs (it sees them), they go to the loggers, ``on_<stage>_end``
runs and the module's train mode comes back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accord.log import rank_zero_info
from accord.loggers.logger import Logger
from accord.trainer.data import num_batches
from accord.trainer.state import RunState

if TYPE_CHECKING:
    from accord.trainer.hooks import RunHooks
    from accord.trainer.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = [
    "batch_mover",
    "evaluate",
    "log_metrics",
    "predict",
    "print_collective_stats",
    "print_timeline_path",
    "rank_zero_loggers",
]

# The hook names of each evaluation stage (the sanity check runs validation's).
_NAMES = {
    "validate": "validation",
    "sanity_check": "validation",
    "test": "test",
    "predict": "predict",
}
_STEPS = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}
_LIMITS = {
    "validation": "limit_val_batches",
    "test": "limit_test_batches",
    "predict": "limit_predict_batches",
}


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


def batch_mover(trainer: Trainer, hooks: RunHooks) -> Callable[[Any], Any]:
    """What takes a loader's batch to the device: the strategy's move, or, where the module
    or datamodule overrides them, ``on_before_batch_transfer``, ``transfer_batch_to_device``
    and ``on_after_batch_transfer`` around it (the datamodule's win, as in Lightning)."""
    strategy = trainer.strategy
    before = hooks.batch_hook("on_before_batch_transfer")
    transfer = hooks.batch_hook("transfer_batch_to_device")
    after = hooks.batch_hook("on_after_batch_transfer")
    if before is None and transfer is None and after is None:
        return strategy.batch_mover()

    def move(batch: Any) -> Any:
        if before is not None:
            batch = before(batch, 0)
        if transfer is None:
            batch = strategy.batch_to_device(batch)
        else:
            batch = strategy.precision.convert_input(transfer(batch, strategy.root_device, 0))
        return after(batch, 0) if after is not None else batch

    return move


def print_collective_stats(stats_by_rank: list[dict[str, dict[str, float]]], stage: str) -> None:
    """Log each rank's collective calls and their time (``profiler="collectives"``), on
    global rank zero."""
    lines = []
    for rank, summary in enumerate(stats_by_rank):
        calls = sum(int(row["calls"]) for row in summary.values())
        lines.append(f"rank {rank}: {calls} collective calls during {stage}")
        for op, row in summary.items():
            lines.append(
                f"  {op:<18} {int(row['calls']):>7} calls  {row['seconds']:9.4f} s  "
                f"{row['mean_ms']:8.3f} ms/call"
            )
    rank_zero_info(log, "%s", "\n".join(lines))


def print_timeline_path(path: Path, stage: str) -> None:
    """Say, on global rank zero, where ``profiler="timeline"`` wrote the merged trace of
    ``stage``."""
    rank_zero_info(
        log,
        "Collective timeline of %s (every rank): %s\nOpen it in https://ui.perfetto.dev or "
        "chrome://tracing; `python -m accord.trace %s --summary` names the straggler.",
        stage,
        path,
        path,
    )


def _batch_count(trainer: Trainer, stage: str, loader: Iterable[Any]) -> int:
    name = _NAMES[stage]
    count = num_batches(loader, getattr(trainer, _LIMITS[name]))
    if stage == "sanity_check":
        count = int(min(count, trainer.num_sanity_val_steps))
    return count


ModuleModes = dict[str, bool]
"""Each submodule's ``training`` flag, by name, as an evaluation found them."""


def _enter_eval(trainer: Trainer, hooks: RunHooks, name: str, in_fit: bool) -> ModuleModes:
    """Put the module in eval mode (through its hooks where it overrides them); return
    every submodule's mode before, to restore after (Lightning's rule)."""
    model = trainer.lightning_module
    assert model is not None
    modes = {key: module.training for key, module in model.named_modules()}
    if in_fit:
        zero_grad = hooks.module_hook("on_validation_model_zero_grad")
        if zero_grad is not None:
            zero_grad()
        else:
            model.zero_grad(set_to_none=True)
    eval_hook = hooks.module_hook(f"on_{name}_model_eval")
    if eval_hook is not None:
        eval_hook()
    else:
        model.eval()
    return modes


def _leave_eval(trainer: Trainer, hooks: RunHooks, name: str, modes: ModuleModes) -> None:
    """The module's modes back: its ``on_<stage>_model_train`` hook where it overrides it,
    else each submodule's own mode as `_enter_eval` found it."""
    train_hook = hooks.module_hook(f"on_{name}_model_train") if name != "predict" else None
    if train_hook is not None:
        train_hook()
        return
    model = trainer.lightning_module
    assert model is not None
    for key, module in model.named_modules():
        if key in modes:
            module.training = modes[key]


def evaluate(
    trainer: Trainer, state: RunState, stage: str, loader: Iterable[Any]
) -> dict[str, float]:
    """One validation (``stage="validate"``, or ``"sanity_check"`` for the fit's first
    few batches) or test pass; return its epoch metrics."""
    hooks, wrapped = state.hooks, state.wrapped
    assert hooks is not None and wrapped is not None
    strategy, metrics = trainer.strategy, state.metrics
    name = _NAMES[stage]
    in_fit = trainer.stage == "fit"
    count = _batch_count(trainer, stage, loader)
    state.eval_batches[stage] = [count]
    trainer.num_eval_batches = count
    previous, state.running = state.running, stage
    context = torch.no_grad() if in_fit else strategy.evaluation_context(trainer.inference_mode)
    with context:
        modes = _enter_eval(trainer, hooks, name, in_fit and stage != "sanity_check")
        metric_stage = "validate" if name == "validation" else stage
        metrics.stage = metric_stage
        metrics.reset(metric_stage)
        hooks.call(f"on_{name}_start")
        hooks.call(f"on_{name}_epoch_start")
        _run_batches(trainer, state, name, loader, count)
        results = metrics.flush_epoch(strategy, metric_stage)
        hooks.call(f"on_{name}_epoch_end")
        results.update(metrics.flush_epoch(strategy, metric_stage))
        if stage != "sanity_check":
            log_metrics(trainer, results)
        hooks.call(f"on_{name}_end")
        _leave_eval(trainer, hooks, name, modes)
    state.running = previous
    if not in_fit and state.verbose:
        _print_results(trainer, stage, results)
    return results


def _run_batches(
    trainer: Trainer, state: RunState, name: str, loader: Iterable[Any], count: int
) -> None:
    hooks, wrapped, metrics = state.hooks, state.wrapped, state.metrics
    assert hooks is not None and wrapped is not None
    strategy = trainer.strategy
    move = batch_mover(trainer, hooks)
    batch_start = hooks.event(f"on_{name}_batch_start")
    batch_end = hooks.event(f"on_{name}_batch_end")
    step = _STEPS[name]
    for batch_idx, batch in enumerate(loader):
        if batch_idx >= count:
            break
        batch = move(batch)
        metrics.batch = batch
        for hook in batch_start:
            hook(batch, batch_idx)
        metrics.in_step = True
        with strategy.forward_context():
            output = strategy.step(wrapped, step, batch, batch_idx)
        metrics.in_step = False
        metrics.flush_step(strategy)
        for hook in batch_end:
            hook(output, batch, batch_idx)


def _print_results(trainer: Trainer, stage: str, results: Mapping[str, float]) -> None:
    """The metrics of a validate/test run, as a small table logged on rank zero
    (Lightning's ``verbose=True``)."""
    if not results:
        return
    width = max(len(key) for key in results)
    title = f"{'Validate' if stage == 'validate' else 'Test'} metric"
    rows = [f"{title:<{width}}  value"]
    rows.extend(f"{key:<{width}}  {results[key]:.6g}" for key in sorted(results))
    rank_zero_info(log, "%s", "\n".join(rows))


def predict(trainer: Trainer, state: RunState, loader: Iterable[Any]) -> list[Any]:
    """Return ``predict_step``'s output for every batch of ``loader``."""
    hooks, wrapped = state.hooks, state.wrapped
    assert hooks is not None and wrapped is not None
    strategy = trainer.strategy
    count = _batch_count(trainer, "predict", loader)
    state.eval_batches["predict"] = [count]
    trainer.num_eval_batches = count
    state.metrics.stage = "predict"
    state.running = "predict"
    move = batch_mover(trainer, hooks)
    batch_start = hooks.event("on_predict_batch_start")
    batch_end = hooks.event("on_predict_batch_end")
    outputs = []
    with strategy.evaluation_context(trainer.inference_mode):
        modes = _enter_eval(trainer, hooks, "predict", False)
        hooks.call("on_predict_start")
        hooks.call("on_predict_epoch_start")
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= count:
                break
            batch = move(batch)
            for hook in batch_start:
                hook(batch, batch_idx)
            with strategy.forward_context():
                output = strategy.step(wrapped, "predict_step", batch, batch_idx)
            outputs.append(output)
            for hook in batch_end:
                hook(output, batch, batch_idx)
        hooks.call("on_predict_epoch_end")
        hooks.call("on_predict_end")
        _leave_eval(trainer, hooks, "predict", modes)
    state.running = None
    return outputs
