"""The fit loop's epoch under manual optimization (``automatic_optimization = False``).

``training_step`` runs its own backward and optimizer steps; the loop only feeds batches,
logs, calls the hooks and validates at its interval. `check_manual` refuses the Trainer
settings that manual optimization leaves to ``training_step``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from accord.errors import ConfigurationError
from accord.trainer.evaluation_loop import batch_mover, log_metrics

if TYPE_CHECKING:
    from accord.trainer.fit_loop import FitLoop
    from accord.trainer.trainer import Trainer

__all__ = ["check_manual", "manual_epoch"]


def manual_epoch(loop: FitLoop, loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
    """An epoch of ``automatic_optimization = False``: ``training_step`` runs its own
    backward and optimizer steps; each ``step()`` counts one ``global_step``."""
    trainer, state, strategy = loop.trainer, loop.state, loop.trainer.strategy
    model, wrapped, metrics, hooks = state.module, state.wrapped, state.metrics, state.hooks
    assert model is not None and wrapped is not None and hooks is not None
    check_manual(trainer)
    total = trainer.num_training_batches
    val_every = loop.val_every(total)
    move = batch_mover(trainer, hooks)
    callback_start = hooks.callback_hooks("on_train_batch_start")
    module_start = hooks.module_hook("on_train_batch_start")
    batch_end = hooks.event("on_train_batch_end")
    for batch_idx, batch in loop.batches(loader):
        trainer.logger_step = steps_before = trainer.global_step
        last = batch_idx + 1 == total
        state.is_last_batch = last
        batch = move(batch)
        metrics.batch = batch
        strategy.on_train_batch_start(batch_idx, last=last)
        for hook in callback_start:
            hook(batch, batch_idx)
        if module_start is not None and module_start(batch, batch_idx) == -1:
            break
        metrics.in_step = True
        with strategy.forward_context():
            output = strategy.step(wrapped, "training_step", batch, batch_idx)
        metrics.in_step = False
        metrics.end_training_step(skipped=False)
        step_metrics = metrics.flush_step(strategy)
        every = trainer.log_every_n_steps
        if every and trainer.global_step > steps_before and trainer.global_step % every == 0:
            log_metrics(trainer, step_metrics)
        state.batches_done = batch_idx + 1
        outputs = (
            output if isinstance(output, dict) else ({"loss": output} if output is not None else {})
        )
        for hook in batch_end:
            hook(outputs, batch, batch_idx)
        if loop.after_batch(batch_idx, val_every, val_loader):
            break


def check_manual(trainer: Trainer) -> None:
    """Refuse what manual optimization leaves to ``training_step``, and the strategies
    that do not run it (`Strategy.check_manual_optimization`).

    The Trainer calls it before it starts any process, and again as training starts.

    Raises:
        ConfigurationError: ``gradient_clip_val`` or ``accumulate_grad_batches`` set, or
            a strategy that does not run manual optimization (FSDP, DeepSpeed, Horovod,
            XLA).
    """
    if trainer.gradient_clip_val is not None:
        raise ConfigurationError(
            "Trainer(gradient_clip_val=...) does not apply under manual optimization "
            "(automatic_optimization = False); call self.clip_gradients(optimizer, value) "
            "in training_step before optimizer.step()."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ConfigurationError(
            "Trainer(accumulate_grad_batches=...) does not apply under manual optimization; "
            "step the optimizers every N batches yourself in training_step (under DDP, "
            "backward inside `with optimizer.toggle_model(sync_grad=False)` on the batches "
            "that do not step skips the gradient all-reduce)."
        )
    trainer.strategy.check_manual_optimization()
