"""One training epoch under automatic optimization, batch by batch, in Lightning's order.

A batch: the transfer hooks, ``on_train_batch_start``, then (on a batch that steps, when
the module overrides ``optimizer_step``) ``optimizer_step(epoch, batch_idx, optimizer,
closure)``, where the closure runs ``training_step``, the ranks' decision on the batch,
``on_before_zero_grad`` and ``optimizer_zero_grad`` (first batch of an accumulation
window), ``on_before_backward``, backward and ``on_after_backward``; the step then runs
``on_before_optimizer_step``, clipping and the strategy's step; then the LR schedulers
due, and ``on_train_batch_end``. Without an override the loop runs the same sequence
directly. Hooks are looked up once per epoch: one nobody defined costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.errors import ConfigurationError
from accord.trainer.evaluation_loop import batch_mover, log_metrics
from accord.trainer.optimizers import due_schedulers, monitored_value
from accord.trainer.rank_loss import Position, Survival
from accord.trainer.step_decision import (
    StepDecision,
    carried_decision,
    decide_step,
    local_bits,
    on_nonfinite,
)
from accord.trainer.step_decision import (
    finite as _finite,
)
from accord.trainer.stepping import Closure, clip, needs_closure

if TYPE_CHECKING:
    from accord.trainer.fit_loop import FitLoop

__all__ = ["TrainingEpoch", "batch_output", "loss_of", "warn_eval_mode"]


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned: a tensor, a dict's ``"loss"``, or None.

    Raises:
        ConfigurationError: any other return value.
    """
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
    raise ConfigurationError(
        f"training_step returned {type(output).__name__}; return the loss tensor, a dict with "
        "a 'loss' key, or None to skip the step."
    )


def batch_output(output: Any, loss: torch.Tensor | None, accumulate: int) -> dict[str, Any]:
    """What ``on_train_batch_end`` gets as ``outputs``, as Lightning hands it over: the
    loss (divided for accumulation, detached) under ``"loss"`` with the other keys of a
    dict ``training_step`` returned; empty for a skipped batch."""
    if loss is None:
        return {}
    value = (loss / accumulate if accumulate > 1 else loss).detach()
    extra = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
    return {"loss": value, **extra}


class TrainingEpoch:
    """The batches of one epoch under automatic optimization.

    Everything a batch asks for is resolved here once: the hooks (what nobody defined is
    an empty tuple or None), the step function, the batch mover, whether there is an
    autocast, a loss scaler or other ranks to agree with; so the loop itself makes few
    calls of its own (``benchmarks/bench_calls.py`` counts them).

    Args:
        loop: the fit loop (its trainer, state and per-window bookkeeping).
    """

    def __init__(self, loop: FitLoop) -> None:
        self.loop = loop
        self.trainer = trainer = loop.trainer
        self.state = state = loop.state
        hooks = state.hooks
        assert hooks is not None and state.module is not None and state.wrapped is not None
        self.model, self.wrapped = state.module, state.wrapped
        self.strategy = strategy = trainer.strategy
        self.accumulate = trainer.accumulate_grad_batches
        self.batch_start = hooks.callback_hooks("on_train_batch_start")
        self.module_batch_start = hooks.module_hook("on_train_batch_start")
        self.batch_end = hooks.event("on_train_batch_end")
        self.before_zero_grad = hooks.event("on_before_zero_grad")
        self.zero_grad_hook = hooks.module_hook("optimizer_zero_grad")
        self.before_backward = hooks.event("on_before_backward")
        self.after_backward = hooks.event("on_after_backward")
        self.backward_fn: Callable[[torch.Tensor], None] | None = hooks.module_hook("backward")
        self.step_hook = hooks.module_hook("optimizer_step")
        self.scheduler_hook = hooks.module_hook("lr_scheduler_step")
        self.before_optimizer_step = hooks.event("on_before_optimizer_step")
        self.clip_hook = hooks.module_hook("configure_gradient_clipping")
        self.move = batch_mover(trainer, hooks)
        context = strategy.forward_context()
        self.autocast = None if isinstance(context, contextlib.nullcontext) else context
        self.unscale = strategy.precision.scaler is not None
        self.custom_step = self.step_hook is not None or any(
            needs_closure(o) for o in state.optimizers
        )
        self.survival = state.survival
        self.refresh()
        # The epoch's size and validation interval, set by `run`.
        self.total: int | float = 0
        self.val_every: int | float = 0
        self.val_loader: Any = None
        self.ran = self.skipped = 0
        # The first batch of the window not stepped on yet; the batch in progress (its
        # output once training_step returned); the last step's batch while its
        # after-work runs. Kept for a regroup (`resume`).
        self.window_start = 0
        self.current: tuple[Any, Any, int] = (None, None, -1)
        self.after: tuple[Any, torch.Tensor | None, Any, int] | None = None
        self.after_stage = 0
        # The epoch's end was reached by a survivor this rank took its state from.
        self.ended_elsewhere = False

    def refresh(self) -> None:
        """Resolve what depends on the wrapped module and the group (again after a regroup)."""
        state, strategy = self.state, self.strategy
        assert state.wrapped is not None
        self.wrapped = state.wrapped
        self.training_step = strategy.step_function(self.wrapped, "training_step")
        self.rank, self.multi_rank = strategy.global_rank, strategy.world_size > 1
        # Where the gradient reduction carries the decision, every backward carries this
        # rank's bits; with one batch per step (no accumulation window to keep) the loop
        # reads the decision after backward instead of agreeing first.
        self.carried = self.multi_rank and strategy.carries_step_decision(self.wrapped)
        self.overlap = self.carried and self.accumulate == 1
        survival = self.survival
        self.weighted = survival is not None and survival.weights is not None
        self.val_loader = self.loop.val_loader

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
                if redo is None or not self.after_batch(*redo):
                    self.train(batches)
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

    def train(self, batches: Iterator[tuple[int, Any]]) -> None:
        """The batches from ``batches`` to the epoch's end (or a stop)."""
        loop, trainer, state, strategy = self.loop, self.trainer, self.state, self.strategy
        metrics, accumulate, wrapped = state.metrics, self.accumulate, self.wrapped
        total, schedulers = self.total, state.schedulers
        for batch_idx, batch in batches:
            if batch_idx >= total:
                break
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
                break
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
                break

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

    def forward_backward(self, batch: Any, batch_idx: int) -> Any:
        """The closure's work: ``training_step``, the ranks' decision, zeroing at a window's
        start, backward with its hooks. Returns ``training_step``'s output; the loss that
        counted (None when the batch was skipped) is left in ``state.last_loss``."""
        loop, state, strategy, wrapped = self.loop, self.state, self.strategy, self.wrapped
        metrics = state.metrics
        metrics.in_step = True
        if self.autocast is None:
            output = self.training_step(batch, batch_idx)
        else:
            with self.autocast:
                output = self.training_step(batch, batch_idx)
        metrics.in_step = False
        self.current = (output, batch, batch_idx)
        loss = output if type(output) is torch.Tensor else loss_of(output)
        first = batch_idx % self.accumulate == 0
        if self.overlap:
            loss = self.carried_backward(loss, first, batch_idx)
        else:
            # One rank with a finite loss and no signal has nothing to agree on.
            if (
                self.multi_rank
                or loss is None
                or loop.signals.received is not None
                or not _finite(loss)
            ):
                loss = self.agree(loss, batch_idx)
            if first:
                self.zero_grad(batch_idx)
        if metrics.pending or (loss is None and metrics.step_values):
            metrics.end_training_step(skipped=loss is None)
        if loss is not None and not self.overlap:
            if self.accumulate > 1:
                loss = loss / self.accumulate
            counted = self.weigh(loss, batch_idx) if self.weighted else loss
            total = strategy.step_decision_term(wrapped, 0, counted) if self.carried else counted
            self.backward(loss, total)
        state.last_loss = loss
        return output

    def weigh(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """``loss`` as much as batch ``batch_idx`` counts in its step, after a regroup
        dealt the step's samples over fewer ranks (`accord.trainer.data.window_loader`)."""
        assert self.survival is not None
        weight = self.survival.weight(batch_idx)
        return loss if weight == 1.0 else loss * weight

    def agree(self, loss: torch.Tensor | None, batch_idx: int) -> torch.Tensor | None:
        """The ranks' decision on this batch (one collective with several ranks); the loss
        that counts, or None for a skipped batch. One collective per batch carries every
        decision the ranks take together: a step one rank skips is skipped by all, since a
        rank that went on to backward alone would wait for the others' gradients forever."""
        signalled = self.loop.signals.received is not None
        decision = decide_step(self.strategy, loss, check_loss=True, signalled=signalled)
        return self.act_on(decision, loss, batch_idx)

    def carried_backward(
        self, loss: torch.Tensor | None, first: bool, batch_idx: int
    ) -> torch.Tensor | None:
        """Backward with the decision carried in the gradient reduction, then read it."""
        strategy, wrapped = self.strategy, self.wrapped
        signalled = self.loop.signals.received is not None
        bits = local_bits(strategy, loss, check_loss=True, signalled=signalled)
        counted = self.weigh(loss, batch_idx) if self.weighted and loss is not None else loss
        term = strategy.step_decision_term(wrapped, bits, counted)
        if first:
            self.zero_grad(batch_idx)
        if loss is not None:
            self.backward(loss, term)
        else:
            strategy.backward(term, wrapped)
        flags = strategy.read_step_decision(wrapped)
        if not any(flags):
            return loss
        decision = carried_decision(flags)
        result = self.act_on(decision, loss, batch_idx)
        if decision.skip:
            self.loop.discard_window()
        return result

    def act_on(
        self, decision: StepDecision, loss: torch.Tensor | None, batch_idx: int
    ) -> torch.Tensor | None:
        """What ``decision`` means for this batch: a skip, a non-finite loss (raise, skip
        or warn), a preemption to carry out at the step boundary."""
        loop, trainer = self.loop, self.trainer
        loop.preempt_ranks = loop.preempt_ranks or decision.preempt_ranks
        if decision.skip:
            return None
        if decision.nonfinite_ranks:
            mode = trainer.on_nonfinite
            on_nonfinite(mode, decision.nonfinite_ranks, trainer.global_step, batch_idx)
            if mode == "skip_step":
                loop.discard_window()
                return None
        return loss

    def zero_grad(self, batch_idx: int) -> None:
        """Clear the gradients at the start of an accumulation window, with the hooks."""
        hook, strategy, wrapped = self.zero_grad_hook, self.strategy, self.wrapped
        for optimizer in self.state.optimizers:
            for before in self.before_zero_grad:
                before(optimizer)
            if hook is not None:
                hook(self.trainer.current_epoch, batch_idx, optimizer)
            else:
                strategy.zero_grad(optimizer, wrapped)

    def backward(self, loss: torch.Tensor, total: torch.Tensor) -> None:
        """The backward hooks (given ``loss``) around the strategy's backward of ``total``:
        the loss, plus the step decision's term where the gradients carry it."""
        for hook in self.before_backward:
            hook(loss)
        self.strategy.backward(total, self.wrapped, self.backward_fn)
        for hook in self.after_backward:
            hook()
        self.loop.window_has_backward = True

    def step_optimizers(self) -> None:
        """Every optimizer's step, without an ``optimizer_step`` override: unscale, the
        ``on_before_optimizer_step`` hooks, clipping, the strategy's step."""
        strategy, wrapped, trainer = self.strategy, self.wrapped, self.trainer
        clipping = self.clip_hook is not None or trainer.gradient_clip_val is not None
        for optimizer in self.state.optimizers:
            if self.unscale:
                strategy.unscale_gradients(optimizer)
            for hook in self.before_optimizer_step:
                hook(optimizer)
            if clipping:
                clip(trainer, self.clip_hook, optimizer)
            strategy.optimizer_step(optimizer, wrapped)

    def custom_optimizer_step(self, batch: Any, batch_idx: int) -> Any:
        """The module's ``optimizer_step`` for each optimizer, with the batch's closure (run
        once: later optimizers get its result).

        Raises:
            ConfigurationError: the override never ran the closure.
        """
        closure = Closure(self, batch, batch_idx)
        step = self.step_hook or self.model.optimizer_step
        epoch = self.trainer.current_epoch
        for index, optimizer in enumerate(self.state.step_optimizers):
            given: Callable[[], Any] = closure if index == 0 else (lambda: loss_of(closure.output))
            step(epoch, batch_idx, optimizer, given)
        if not closure.ran:
            raise ConfigurationError(
                f"{type(self.model).__name__}.optimizer_step() did not run the closure it "
                "was given, so training_step never ran: call "
                "optimizer.step(closure=optimizer_closure) (or optimizer_closure()) in it."
            )
        return closure.output

    def step_schedulers(self, interval: str, index: int, plateau: bool) -> None:
        """Step the ``interval`` schedulers due at ``index`` through ``lr_scheduler_step``
        (``plateau``: the monitored ones, stepped after ``on_train_epoch_end``)."""
        state = self.state
        due = due_schedulers(state.schedulers, interval, index, plateau)
        if not due:
            return
        metrics = self.trainer.callback_metrics
        hook = self.scheduler_hook
        for config in due:
            value = monitored_value(config, metrics)
            if config.monitor is not None and value is None:
                continue
            if hook is not None:
                hook(config.scheduler, value)
            elif value is None:
                config.scheduler.step()
            else:
                config.scheduler.step(value)
        if interval == "epoch":
            state.epoch_schedulers_stepped.update(id(c) for c in due)


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
