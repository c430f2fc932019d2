"""One training epoch under automatic optimization, batch by batch, in Lightning's order.

A batch: the transfer hooks, ``on_train_batch_start``, then (on a batch that steps, when
the module overrides ``optimizer_step``) ``optimizer_step(epoch, batch_idx, optimizer,
closure)``, where the closure runs ``training_step``, the ranks' decision on the batch,
``on_before_zero_grad`` and ``optimizer_zero_grad`` (first batch of an accumulation
window), ``on_before_backward``, backward and ``on_after_backward``; the step then runs
``on_before_optimizer_step``, clipping and the strategy's step; then the LR schedulers
due, and ``on_train_batch_end``. Without an override the loop runs the same sequence
directly. Hooks are looked up once per epoch: one nobody defined costs nothing.

The work of one batch is `accord.trainer.automatic_step.AutomaticStep`'s, which
`TrainingEpoch` extends with the epoch's course.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.trainer.automatic_step import AutomaticStep, loss_of
from accord.trainer.evaluation_loop import log_metrics
from accord.trainer.rank_loss import Position, Survival

if TYPE_CHECKING:
    from accord.trainer.fit_loop import FitLoop

__all__ = ["TrainingEpoch", "batch_output", "loss_of", "warn_eval_mode"]


def batch_output(output: Any, loss: torch.Tensor | None, accumulate: int) -> dict[str, Any]:
    """What ``on_train_batch_end`` gets as ``outputs``, as Lightning hands it over: the
    loss (divided for accumulation, detached) under ``"loss"`` with the other keys of a
    dict ``training_step`` returned; empty for a skipped batch."""
    if loss is None:
        return {}
    value = (loss / accumulate if accumulate > 1 else loss).detach()
    extra = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
    return {"loss": value, **extra}


class TrainingEpoch(AutomaticStep):
    """The batches of one epoch under automatic optimization: each batch's work
    (`AutomaticStep`), what follows it, validation at its interval, and under
    ``on_rank_loss="continue"`` the regroup's resume and a replacement taken in.

    Args:
        loop: the fit loop (its trainer, state and per-window bookkeeping).
    """

    def __init__(self, loop: FitLoop) -> None:
        super().__init__(loop)
        # The epoch's size and validation interval, set by `run`.
        self.total: int | float = 0
        self.val_every: int | float = 0
        self.val_loader = None
        self.ran = self.skipped = 0
        # The first batch of the window not stepped on yet; the last step's batch while
        # its after-work runs. Kept for a regroup (`resume`), with the batch in progress
        # (`current`).
        self.window_start = 0
        self.after: tuple[Any, torch.Tensor | None, Any, int] | None = None
        self.after_stage = 0
        # The epoch's end was reached by a survivor this rank took its state from.
        self.ended_elsewhere = False

    def run(self, loader: Iterable[Any], val_loader: Any) -> None:
        """Train on this epoch's batches of ``loader``, validating at the interval. Under
        ``on_rank_loss="continue"``, a lost rank's failed wait regroups the survivors and
        the unit it struck is run again (`accord.trainer.rank_loss`)."""
        loop, survival = self.loop, self.survival
        self.total = self.trainer.num_training_batches
        self.val_every = loop.val_every(self.total)
        self.val_loader = val_loader
        iterator, skip = loop.epoch_iterator(loader)
        if survival is not None:
            survival.begin_epoch(loader)
        self.window_start = skip
        batches: Iterator[tuple[int, Any]] = enumerate(iterator, start=skip)
        redo: tuple[Any, torch.Tensor | None, Any, int, int] | None = None
        while True:
            try:
                stopped = redo is not None and self.after_batch(*redo)
                redo = None
                if not stopped:
                    stopped = self.train(batches)
                if self.grow_pending:
                    batches = self.grow(survival)
                    if not stopped:
                        continue
                break
            except Exception as err:
                if survival is None or not survival.handles(err):
                    raise
                resumed = self.resume(survival, err)
                if resumed is None:
                    return
                batches, redo = resumed
        if self.ran and self.skipped == self.ran:
            loop.warn_all_skipped()

    def train(self, batches: Iterator[tuple[int, Any]]) -> bool:
        """The batches from ``batches`` to the epoch's end or a stop (True), or to the end
        of a window after which the ranks take in a replacement (False)."""
        loop, trainer, state, strategy = self.loop, self.trainer, self.state, self.strategy
        metrics, accumulate, wrapped = state.metrics, self.accumulate, self.wrapped
        total, schedulers = self.total, state.schedulers
        for batch_idx, batch in batches:
            if batch_idx >= total:
                return True
            loop.total_batches += 1
            trainer.logger_step = trainer.global_step
            last = batch_idx + 1 == total
            is_step = last or (batch_idx + 1) % accumulate == 0
            state.is_last_batch = last
            batch = self.move(batch)
            metrics.batch = batch
            self.current = (None, batch, batch_idx)
            strategy.on_train_batch_start(batch_idx, last, is_step)
            starts = self.batch_start or self.module_batch_start is not None
            if starts and self.call_batch_start(batch, batch_idx):
                return True
            if not is_step:
                with strategy.no_backward_sync(wrapped, enabled=True):
                    output = self.forward_backward(batch, batch_idx)
            elif self.custom_step:
                output = self.custom_optimizer_step(batch, batch_idx)
            else:
                output = self.forward_backward(batch, batch_idx)
                if loop.window_has_backward:
                    self.step_optimizers()
            self.ran += 1
            loss = state.last_loss
            self.skipped += loss is None
            if is_step:
                loop.window_has_backward = False
                trainer.global_step += 1
                if schedulers:
                    self.step_schedulers("step", batch_idx + 1, plateau=False)
                if schedulers and last:
                    self.step_schedulers("epoch", trainer.current_epoch + 1, plateau=False)
                self.window_start = batch_idx + 1
                self.after = (output, loss, batch, batch_idx)
                self.after_stage = 0
            if self.after_batch(output, loss, batch, batch_idx):
                return True
            if is_step and self.grow_pending:
                return False  # `run` takes the replacement in, then goes on from here
        return True

    def after_batch(
        self, output: Any, loss: torch.Tensor | None, batch: Any, batch_idx: int, stage: int = 0
    ) -> bool:
        """What follows a batch, from ``stage`` on: its step's metrics and logging (stage
        0), each ``on_train_batch_end`` hook (1 to n), a preemption's save at a step (n +
        1), validation at its interval (n + 2). `after_stage` follows, so a regroup runs
        the interrupted stage again, not the ones done. Returns whether the epoch stops."""
        loop, trainer, state, strategy = self.loop, self.trainer, self.state, self.strategy
        metrics, accumulate, hooks = state.metrics, self.accumulate, self.batch_end
        is_step = batch_idx + 1 == self.total or (batch_idx + 1) % accumulate == 0
        if stage == 0 and metrics.step_values:
            step_metrics = metrics.flush_step(strategy)
            log_every = trainer.log_every_n_steps
            if is_step and log_every and trainer.global_step % log_every == 0:
                log_metrics(trainer, step_metrics)
        state.batches_done = batch_idx + 1
        if hooks:
            outputs = batch_output(output, loss, accumulate)
            for index in range(max(stage - 1, 0), len(hooks)):
                self.after_stage = index + 1
                hooks[index](outputs, batch, batch_idx)
        self.after_stage = len(hooks) + 1
        if loop.preempt_ranks and is_step and stage <= len(hooks) + 1:
            loop.preempt()
        self.after_stage = len(hooks) + 2
        val_loader = self.val_loader
        stop = (
            (
                (val_loader is not None and trainer.has_validation)
                and (batch_idx + 1) % self.val_every == 0
            )
            or trainer.should_stop
            or trainer.global_step == trainer.max_steps
            or not loop.counts_epoch_batches
        ) and loop.after_batch(batch_idx, self.val_every, val_loader)
        self.after = None
        return stop

    def grow(self, survival: Survival | None) -> Iterator[tuple[int, Any]]:
        """Take in the replacements the ranks agreed on (`Survival.grow`); the batches of
        the epoch from the next window on, dealt over the larger group."""
        trainer, state = self.trainer, self.state
        assert survival is not None and state.train_loader is not None
        self.grow_pending = False
        position = Position(trainer.current_epoch, trainer.global_step, "window", self.window_start)
        survival.grow(position)
        self.refresh()
        self.weighted = True
        start = self.window_start
        return enumerate(survival.batches(state.train_loader, start), start=start)

    def resume(
        self, survival: Survival, error: BaseException
    ) -> (
        tuple[Iterator[tuple[int, Any]], tuple[Any, torch.Tensor | None, Any, int, int] | None]
        | None
    ):
        """Regroup after ``error`` and say how this epoch goes on: the batches from the
        window every survivor runs again, and the after-work to run first (of the last
        step taken), if that is what was interrupted. None when the epoch has ended (a
        survivor this rank took its state from was past it)."""
        trainer, state = self.trainer, self.state
        epoch = trainer.current_epoch
        after = self.after is not None
        position = Position(
            epoch,
            trainer.global_step,
            "after" if after else "window",
            self.window_start,
            self.after_stage if after else 0,
        )
        resumed = survival.recover(error, position)
        self.refresh()
        self.loop.discard_window()
        if trainer.current_epoch != epoch:
            self.ended_elsewhere = True
            return None
        target = resumed.position
        redo = None
        if target.unit == "after":
            if self.after is not None:
                redo = (*self.after, target.stage)
            else:  # this rank had not taken the step: its batch in progress
                output, batch, batch_idx = self.current
                loss = state.last_loss if output is not None else None
                redo = (output, loss, batch, batch_idx, target.stage)
        self.window_start = target.window_start
        assert state.train_loader is not None
        batches = enumerate(
            survival.batches(state.train_loader, target.window_start), start=target.window_start
        )
        self.weighted = True
        return batches, redo

    def call_batch_start(self, batch: Any, batch_idx: int) -> bool:
        """The ``on_train_batch_start`` hooks; True when the module's returned ``-1``: the
        rest of the epoch is skipped (the epoch's schedulers still step)."""
        for hook in self.batch_start:
            hook(batch, batch_idx)
        own = self.module_batch_start
        if own is not None and own(batch, batch_idx) == -1:
            self.step_schedulers("epoch", self.trainer.current_epoch + 1, plateau=False)
            return True
        return False


def warn_eval_mode(model: torch.nn.Module) -> None:
    """Warn when some of the module's layers are in eval mode as training starts (as
    Lightning does): they stay so, which is rarely meant."""
    frozen = [name for name, module in model.named_modules() if not module.training]
    if frozen:
        rank_zero_warn(
            f"{len(frozen)} module(s) are in eval mode as training starts ({', '.join(frozen[:5])}"
            f"{', ...' if len(frozen) > 5 else ''}); they stay in eval mode while training. "
            "Call .train() on them first if that is not meant.",
            category=UserWarning,
        )
