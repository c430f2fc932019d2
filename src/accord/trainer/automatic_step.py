"""`AutomaticStep`: the work of one batch under automatic optimization.

``training_step`` (under the strategy's autocast), the ranks' decision on the batch (one
collective, or carried in the gradient reduction), zeroing at a window's start, backward
with its hooks, the optimizer step (the module's ``optimizer_step`` with a closure where it
overrides it) and the LR schedulers due. `accord.trainer.training_epoch.TrainingEpoch`
builds on it: the epoch's batches, what follows each, and a regroup's resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from accord.core.membership import MemberCollective
from accord.errors import ConfigurationError
from accord.trainer.evaluation_loop import batch_mover
from accord.trainer.optimizers import due_schedulers, monitored_value
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

__all__ = ["AutomaticStep", "loss_of"]


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


class AutomaticStep:
    """One batch's forward, backward and optimizer step under automatic optimization.

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
        # The batch in progress (its output once training_step returned), kept for a
        # regroup.
        self.current: tuple[Any, Any, int] = (None, None, -1)
        # The ranks agreed to take in a replacement at the end of the current window.
        self.grow_pending = False

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
        self.val_loader: Any = self.loop.val_loader
        # Where the run goes on without lost ranks, replacements may ask to join.
        base = strategy.base_collective
        self.membership = (
            base if survival is not None and isinstance(base, MemberCollective) else None
        )

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
        dealt the step's samples over fewer ranks (`accord.trainer.dealing.window_loader`)."""
        assert self.survival is not None
        weight = self.survival.weight(batch_idx)
        return loss if weight == 1.0 else loss * weight

    def agree(self, loss: torch.Tensor | None, batch_idx: int) -> torch.Tensor | None:
        """The ranks' decision on this batch (one collective with several ranks); the loss
        that counts, or None for a skipped batch. One collective per batch carries every
        decision the ranks take together: a step one rank skips is skipped by all, since a
        rank that went on to backward alone would wait for the others' gradients forever."""
        signalled = self.loop.signals.received is not None
        grow = self.membership is not None and self.membership.join_pending
        decision = decide_step(self.strategy, loss, True, signalled, grow)
        return self.act_on(decision, loss, batch_idx)

    def carried_backward(
        self, loss: torch.Tensor | None, first: bool, batch_idx: int
    ) -> torch.Tensor | None:
        """Backward with the decision carried in the gradient reduction, then read it."""
        strategy, wrapped = self.strategy, self.wrapped
        signalled = self.loop.signals.received is not None
        grow = self.membership is not None and self.membership.join_pending
        bits = local_bits(strategy, loss, True, signalled, grow)
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
        self.grow_pending = self.grow_pending or decision.grow
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
