"""`FitLoop`: epochs of training batches, optimizer steps, and validation at its interval."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.errors import ConfigurationError
from accord.module import Module
from accord.trainer.checkpointing import epoch_batches
from accord.trainer.data import num_batches, overrides, set_epoch
from accord.trainer.loops import (
    call_callbacks,
    callback_hooks,
    evaluate,
    log_metrics,
    module_hook,
)
from accord.trainer.manual_loop import manual_epoch
from accord.trainer.optimizers import optimizer_step, step_schedulers
from accord.trainer.preemption import SignalFlag, save_and_stop
from accord.trainer.state import RunState
from accord.trainer.step_decision import (
    carried_decision,
    decide_step,
    local_bits,
    on_nonfinite,
)

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["FitLoop", "loss_of"]


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


class FitLoop:
    """One ``trainer.fit``: runs epochs until ``max_epochs``/``max_steps`` or a stop.

    Args:
        trainer: the Trainer whose settings and counters the loop uses.
        state: the Trainer's working state (module, optimizers, position in the epoch).
    """

    def __init__(self, trainer: Trainer, state: RunState) -> None:
        self.trainer = trainer
        self.state = state
        # Whether a batch of the current accumulation window ran backward.
        self.window_has_backward = False
        self.warned_all_skipped = False
        self.signals = SignalFlag(trainer.preemption_signals)
        # The ranks that received a preemption signal, once the ranks agreed to stop for
        # it; they stop at the next step boundary.
        self.preempt_ranks: tuple[int, ...] = ()

    def run(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        """Train on ``train_loader``, validating on ``val_loader`` (already prepared)."""
        trainer, state = self.trainer, self.state
        model = state.module
        assert model is not None and state.wrapped is not None
        trainer.has_validation = (
            val_loader is not None
            and overrides(model, "validation_step")
            and trainer.limits["validate"] != 0
        )
        trainer.num_training_batches = num_batches(train_loader, trainer.limits["train"])
        trainer.should_stop = False
        if self._nothing_to_train(train_loader):
            return
        self.signals.install()
        try:
            self._run(model, train_loader, val_loader)
        finally:
            self.signals.restore()

    def _run(
        self, model: Module, train_loader: Iterable[Any], val_loader: Iterable[Any] | None
    ) -> None:
        trainer, state = self.trainer, self.state
        call_callbacks(trainer, "on_fit_start")
        model.on_fit_start()
        call_callbacks(trainer, "on_train_start")
        model.on_train_start()
        while not self._done():
            set_epoch(train_loader, trainer.current_epoch)
            model.train()
            state.metrics.stage = "train"
            call_callbacks(trainer, "on_train_epoch_start")
            model.on_train_epoch_start()
            state.epoch_schedulers_stepped = False
            if model.automatic_optimization:
                self._train_epoch(train_loader, val_loader)
            else:
                manual_epoch(self, train_loader, val_loader)
            model.on_train_epoch_end()
            log_metrics(trainer, state.metrics.flush_epoch(trainer.strategy, "train"))
            # Before the callbacks, so a checkpoint saved at the end of the epoch holds the
            # schedulers as the next epoch starts with them (as Lightning's does).
            self._step_schedulers("epoch", trainer.current_epoch + 1)
            state.epoch_schedulers_stepped = True
            call_callbacks(trainer, "on_train_epoch_end")
            trainer.current_epoch += 1
            state.batches_done = 0
            if trainer.should_stop:
                break
        call_callbacks(trainer, "on_train_end")
        model.on_train_end()
        call_callbacks(trainer, "on_fit_end")
        model.on_fit_end()

    def _nothing_to_train(self, loader: Iterable[Any]) -> bool:
        """Say why a fit would train nothing: an empty loader (an error), no batches
        allowed or a run already finished (warnings). True when the fit stops here."""
        trainer = self.trainer
        if trainer.num_training_batches == 0 and getattr(loader, "__len__", None) is not None:
            if len(loader) == 0:  # type: ignore[arg-type]
                raise ConfigurationError(
                    "The training loader has no batches (its dataset is empty, or smaller than "
                    "one batch with drop_last=True), so fit() has nothing to train on. Check "
                    "the dataset and the loader's batch_size."
                )
            rank_zero_warn(
                f"limit_train_batches={trainer.limits['train']!r} leaves no training batch, so "
                "fit() trains nothing and stops. Set it to at least 1 batch (or a fraction "
                "that covers one); to only evaluate, call trainer.validate().",
                category=UserWarning,
            )
            return True
        if self._done():
            limit = (
                f"max_steps={trainer.max_steps} (global_step={trainer.global_step})"
                if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
                else f"max_epochs={trainer.max_epochs} (current_epoch={trainer.current_epoch})"
            )
            rank_zero_warn(
                f"fit() did nothing: this run already reached {limit}, so no epoch is left "
                "to train. Raise max_epochs/max_steps to train further (with "
                "ckpt_path= to resume), or create a new Trainer to train again.",
                category=UserWarning,
            )
            return True
        return False

    def _done(self) -> bool:
        trainer = self.trainer
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        return trainer.max_epochs is not None and trainer.current_epoch >= trainer.max_epochs

    def _step_schedulers(self, interval: str, count: int) -> None:
        if not self.state.schedulers:
            return
        model = self.state.module
        if model is not None and not model.automatic_optimization:
            # Under manual optimization training_step steps them, as in Lightning.
            return
        step_schedulers(self.state.schedulers, interval, count, self.trainer.callback_metrics)

    def batches(self, loader: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """This epoch's ``(batch_idx, batch)`` pairs, from where a resumed run stopped."""
        state = self.state
        # On resume, the RNG is put back where the interrupted run had it when this epoch's
        # iterator was made (so a shuffled order repeats), then where it was at the save.
        resume, state.resume_rng = state.resume_rng, None
        if resume is not None:
            start, at_save = resume
            torch.set_rng_state(start if start is not None else at_save)
        state.rng_epoch_start = torch.get_rng_state()
        iterator, skip = epoch_batches(self.trainer, state, loader)
        if resume is not None and resume[0] is not None:
            torch.set_rng_state(resume[1])
        for batch_idx, batch in enumerate(iterator, start=skip):
            if batch_idx >= self.trainer.num_training_batches:
                return
            yield batch_idx, batch

    def _train_epoch(self, loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        trainer, state = self.trainer, self.state
        model, strategy, wrapped, metrics = (
            state.module,
            trainer.strategy,
            state.wrapped,
            state.metrics,
        )
        assert model is not None and wrapped is not None
        accumulate = trainer.accumulate_grad_batches
        total = trainer.num_training_batches
        val_every = self.val_every(total)
        multi_rank = strategy.world_size > 1
        # The hooks a batch calls, resolved once: the ones the user did not define do nothing.
        batch_start = module_hook(model, "on_train_batch_start")
        before_backward = module_hook(model, "on_before_backward")
        after_backward = module_hook(model, "on_after_backward")
        batch_end = module_hook(model, "on_train_batch_end")
        callbacks_batch_end = callback_hooks(trainer, "on_train_batch_end")
        # Where the gradient reduction carries the decision, every backward carries this
        # rank's bits; with one batch per step (no accumulation window to keep) the loop
        # reads the decision after backward instead of agreeing first.
        carried = multi_rank and strategy.carries_step_decision(wrapped)
        overlap = carried and accumulate == 1
        ran = skipped = 0
        for batch_idx, batch in self.batches(loader):
            trainer.logger_step = trainer.global_step
            batch = strategy.batch_to_device(batch)
            strategy.on_train_batch_start(batch_idx, last=batch_idx + 1 == total)
            if batch_start is not None:
                batch_start(batch, batch_idx)
            is_step = (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == total
            with strategy.no_backward_sync(wrapped, enabled=not is_step):
                metrics.in_step = True
                with strategy.forward_context():
                    output = strategy.step(wrapped, "training_step", batch, batch_idx)
                metrics.in_step = False
                loss = loss_of(output)
                signalled = self.signals.received is not None
                # One collective per batch for every decision the ranks take together. A
                # step one rank skips is skipped by all: a rank that went on to backward
                # alone would wait for the others' gradients forever.
                if overlap:
                    bits = local_bits(strategy, loss, check_loss=True, signalled=signalled)
                    term = strategy.step_decision_term(wrapped, bits, loss)
                    if loss is not None:
                        self._backward(loss, before_backward, after_backward, term)
                    else:
                        strategy.backward(term, wrapped)
                    decision = carried_decision(strategy.read_step_decision(wrapped))
                else:
                    decision = decide_step(strategy, loss, check_loss=True, signalled=signalled)
                self.preempt_ranks = self.preempt_ranks or decision.preempt_ranks
                ran += 1
                if decision.skip:
                    loss = None
                    skipped += 1
                    if overlap:
                        self._discard_window()
                elif decision.nonfinite_ranks:
                    mode = trainer.on_nonfinite
                    on_nonfinite(
                        mode,
                        decision.nonfinite_ranks,
                        trainer.global_step,
                        batch_idx,
                        trainer.is_global_zero,
                    )
                    if mode == "skip_step":
                        loss = None
                        self._discard_window()
                metrics.end_training_step(skipped=loss is None)
                if loss is not None and not overlap:
                    if accumulate > 1:
                        loss = loss / accumulate
                    total_loss = strategy.step_decision_term(wrapped, 0, loss) if carried else loss
                    self._backward(loss, before_backward, after_backward, total_loss)
            if is_step:
                self._optimizer_step()
            step_metrics = metrics.flush_step(strategy)
            if is_step and trainer.global_step % trainer.log_every_n_steps == 0:
                log_metrics(trainer, step_metrics)
            state.batches_done = batch_idx + 1
            for hook in callbacks_batch_end:
                hook(trainer, model, output, batch, batch_idx)
            if batch_end is not None:
                batch_end(output, batch, batch_idx)
            if self.preempt_ranks and is_step:
                save_and_stop(trainer, self.preempt_ranks, self.signals.received)
            if self.after_batch(batch_idx, val_every, val_loader):
                break
        if ran and skipped == ran and not self.warned_all_skipped:
            self.warned_all_skipped = True
            rank_zero_warn(
                f"training_step returned None for every batch of epoch {trainer.current_epoch}"
                f"{' on at least one rank' if multi_rank else ''}, so nothing was trained. "
                "Return the loss (a tensor, or a dict with a 'loss' key); return None only "
                "to skip a batch on purpose.",
                category=UserWarning,
            )

    def _backward(
        self,
        loss: torch.Tensor,
        before: Callable[[torch.Tensor], None] | None,
        after: Callable[[], None] | None,
        total: torch.Tensor,
    ) -> None:
        """The module's backward hooks (given ``loss``) around the strategy's backward of
        ``total``: the loss, plus the step decision's term where the gradients carry it."""
        if before is not None:
            before(loss)
        assert self.state.wrapped is not None
        self.trainer.strategy.backward(total, self.state.wrapped)
        if after is not None:
            after()
        self.window_has_backward = True

    def val_every(self, total: int) -> int:
        """Validate every this many batches of an epoch of ``total`` (`val_check_interval`)."""
        interval = self.trainer.val_check_interval
        if interval is None:
            return total
        if isinstance(interval, float):
            return max(1, int(total * interval))
        return interval

    def after_batch(self, batch_idx: int, val_every: int, val_loader: Iterable[Any] | None) -> bool:
        """Validate if it is due after ``batch_idx``; whether the epoch stops here (a
        stop was asked for, or ``max_steps`` is reached)."""
        trainer, state = self.trainer, self.state
        if val_loader is not None and self._should_validate(batch_idx, val_every):
            evaluate(trainer, state, "validate", val_loader)
            assert state.module is not None
            state.module.train()
            state.metrics.stage = "train"
        return trainer.should_stop or (
            trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        )

    def _should_validate(self, batch_idx: int, every: int) -> bool:
        trainer = self.trainer
        if (
            not trainer.has_validation
            or (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch
        ):
            return False
        return (batch_idx + 1) % every == 0

    def _discard_window(self) -> None:
        """Drop the gradients of the current accumulation window on every optimizer."""
        state = self.state
        assert state.wrapped is not None
        for optimizer in state.optimizers:
            self.trainer.strategy.zero_grad(optimizer, state.wrapped)
        self.window_has_backward = False

    def _optimizer_step(self) -> None:
        trainer, state = self.trainer, self.state
        assert state.module is not None and state.wrapped is not None
        # A window whose every batch was skipped has no gradients: nothing to apply. The
        # step still counts, as in Lightning, so max_steps and step schedulers advance.
        if self.window_has_backward:
            optimizer_step(
                trainer.strategy,
                state.module,
                state.wrapped,
                state.optimizers,
                trainer.gradient_clip_val,
            )
        self.window_has_backward = False
        trainer.global_step += 1
        self._step_schedulers("step", trainer.global_step)
