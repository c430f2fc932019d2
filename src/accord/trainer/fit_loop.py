"""`FitLoop`: the sanity check (`accord.trainer.sanity_check`), then epochs of training
batches with validation at its interval, until ``max_epochs``/``max_steps``, ``max_time``
or a stop (honoured once ``min_epochs``/``min_steps`` are reached)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import WarningCache, rank_zero_warn

from accord.errors import ConfigurationError
from accord.module import Module
from accord.trainer.data import num_batches, prepare_loader, set_epoch
from accord.trainer.evaluation_loop import evaluate, log_metrics
from accord.trainer.manual_loop import manual_epoch
from accord.trainer.preemption import SignalFlag, save_and_stop
from accord.trainer.rank_loss import Position
from accord.trainer.sanity_check import sanity_check
from accord.trainer.sources import LoaderSource
from accord.trainer.state import RunState
from accord.trainer.training_checkpoints import epoch_batches
from accord.trainer.training_epoch import TrainingEpoch, warn_eval_mode

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["FitLoop", "train_preparer"]

_WARNINGS = WarningCache()
"""Warnings a process gives once, on rank zero."""


class FitLoop:
    """One ``trainer.fit``: the sanity check, then epochs until a limit or a stop.

    Args:
        trainer: the Trainer whose settings and counters the loop uses.
        state: the Trainer's working state (module, optimizers, position in the epoch).
        val_source: where the validation loader comes from, or None.
    """

    def __init__(self, trainer: Trainer, state: RunState, val_source: LoaderSource | None) -> None:
        self.trainer = trainer
        self.state = state
        self.val_source = val_source
        self.val_loader: Iterable[Any] | None = None
        # Whether a batch of the current accumulation window ran backward.
        self.window_has_backward = False
        self.signals = SignalFlag(trainer.preemption_signals)
        # The ranks that received a preemption signal, once the ranks agreed to stop for
        # it; they stop at the next step boundary.
        self.preempt_ranks: tuple[int, ...] = ()
        self.total_batches = 0
        # Validation counts batches per epoch (False: over the whole fit).
        self.counts_epoch_batches = trainer.check_val_every_n_epoch is not None
        self._train_reloaded = self._val_reloaded = -1

    def run(self) -> None:
        """Run the fit: hooks, sanity check, epochs."""
        trainer, state = self.trainer, self.state
        model = state.module
        assert model is not None and state.wrapped is not None and state.hooks is not None
        state.fit_loop = self
        trainer.should_stop = False
        trainer.has_validation = self.val_source is not None and trainer.limit_val_batches != 0
        state.hooks.call("on_fit_start")
        # Lightning's order: the sanity check asks for the validation loader, then the fit
        # for the training loader (unless estimated_stepping_batches already did). A
        # replacement joining a run in progress has nothing to check.
        if not trainer.strategy.rejoining:
            sanity_check(self)
        if state.prepare_train is not None:
            state.prepare_train()
        self._train_reloaded = trainer.current_epoch
        if trainer.has_validation and self.val_loader is None:
            self.load_val()
        if self._nothing_to_train(state.train_loader):
            state.hooks.call("on_fit_end")
            return
        self.signals.install()
        anomaly = (
            torch.autograd.set_detect_anomaly(True)
            if trainer.detect_anomaly
            else contextlib.nullcontext()
        )
        try:
            with anomaly:
                self._epochs(model)
        finally:
            state.received_sigterm = self.signals.received_sigterm
            self.signals.restore()
        state.hooks.call("on_fit_end")

    def _epochs(self, model: Module) -> None:
        trainer, state = self.trainer, self.state
        hooks = state.hooks
        assert hooks is not None
        warn_eval_mode(model)
        state.running = "train"
        hooks.call("on_train_start")
        while not self._done():
            self._reload_loaders()
            loader = state.train_loader
            set_epoch(loader, trainer.current_epoch)
            state.running = "train"
            state.metrics.stage = "train"
            hooks.call("on_train_epoch_start")
            state.epoch_schedulers_stepped = set()
            if model.automatic_optimization:
                epoch = TrainingEpoch(self)
                epoch.run(loader, self.val_loader)
                if epoch.ended_elsewhere:
                    continue  # a survivor ahead of this rank ended it; its state came over
            else:
                epoch = None
                manual_epoch(self, loader, self.val_loader)
            self._finish_epoch(epoch)
        hooks.call("on_train_end")
        state.running = None

    def _finish_epoch(self, epoch: TrainingEpoch | None) -> None:
        """`_end_epoch`; under ``on_rank_loss="continue"``, run again on the survivors of a
        lost rank (`accord.trainer.rank_loss`), unless a survivor was already past it."""
        survival, trainer = self.state.survival, self.trainer
        while True:
            try:
                self._end_epoch(epoch)
                return
            except Exception as err:
                if survival is None or not survival.handles(err):
                    raise
                current = trainer.current_epoch
                position = Position(
                    current, trainer.global_step, "epoch_end", int(trainer.num_training_batches)
                )
                survival.recover(err, position)
                self.discard_window()
                if trainer.current_epoch != current:
                    return

    def _end_epoch(self, epoch: TrainingEpoch | None) -> None:
        """The epoch's end, in Lightning's order: its training metrics synced, the other
        callbacks' ``on_train_epoch_end``, the module's, the monitoring callbacks', the
        monitored LR schedulers, the metrics to the loggers."""
        trainer, state, strategy = self.trainer, self.state, self.trainer.strategy
        hooks = state.hooks
        assert hooks is not None
        metrics = state.metrics
        state.running = "train"
        metrics.stage = "train"
        results = metrics.flush_epoch(strategy, "train")
        for hook in hooks.callback_hooks("on_train_epoch_end", monitoring=False):
            hook()
        own = hooks.module_hook("on_train_epoch_end")
        if own is not None:
            own()
            results.update(metrics.flush_epoch(strategy, "train"))
        for hook in hooks.callback_hooks("on_train_epoch_end", monitoring=True):
            hook()
        results.update(metrics.flush_epoch(strategy, "train"))
        if epoch is not None:
            epoch.step_schedulers("epoch", trainer.current_epoch + 1, plateau=True)
        log_metrics(trainer, results)
        trainer.current_epoch += 1
        state.batches_done = 0
        state.running = None

    # --------------------------------------------------------------- the data
    def load_val(self) -> None:
        """Make the validation loader from its source, this rank's share of it (None without
        a source)."""
        trainer = self.trainer
        if self.val_source is None:
            self.val_loader = None
            return
        self.val_loader = prepare_loader(
            self.val_source.load(),
            "validate",
            trainer.strategy.distributed_sampler_kwargs,
            distributed_sampler=trainer.use_distributed_sampler,
        )
        self.state.val_loader = self.val_loader
        self._val_reloaded = trainer.current_epoch
        if num_batches(self.val_loader, trainer.limit_val_batches) == 0:
            trainer.has_validation = False

    def _reload_loaders(self) -> None:
        """New loaders from the hooks every ``reload_dataloaders_every_n_epochs`` epochs."""
        trainer, state = self.trainer, self.state
        every = trainer.reload_dataloaders_every_n_epochs
        if not every:
            return
        epoch = trainer.current_epoch
        if epoch - self._train_reloaded >= every:
            train_preparer(trainer, state)()
            self._train_reloaded = epoch
        if self.val_source is not None and epoch - self._val_reloaded >= every:
            self.load_val()

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
                f"limit_train_batches={trainer.limit_train_batches!r} leaves no training "
                "batch, so fit() trains nothing and stops. Set it to at least 1 batch (or a "
                "fraction that covers one); to only evaluate, call trainer.validate().",
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

    # ------------------------------------------------------------------ limits
    def can_stop_early(self) -> bool:
        """Whether ``min_epochs`` and ``min_steps`` are reached, so a stop is honoured."""
        trainer = self.trainer
        epochs_met = trainer.min_epochs is None or trainer.current_epoch >= trainer.min_epochs
        steps_met = trainer.min_steps is None or trainer.global_step >= trainer.min_steps
        return epochs_met and steps_met

    def _done(self) -> bool:
        trainer = self.trainer
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        if max_epochs is not None and max_epochs != -1 and trainer.current_epoch >= max_epochs:
            return True
        return trainer.should_stop and self.can_stop_early()

    def batches(self, loader: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """This epoch's ``(batch_idx, batch)`` pairs, from where a resumed run stopped."""
        iterator, skip = self.epoch_iterator(loader)
        for batch_idx, batch in enumerate(iterator, start=skip):
            if batch_idx >= self.trainer.num_training_batches:
                return
            self.total_batches += 1
            yield batch_idx, batch

    def epoch_iterator(self, loader: Iterable[Any]) -> tuple[Iterator[Any], int]:
        """This epoch's batches from where a resumed run stopped, and the first one's index
        (the caller stops at ``num_training_batches``)."""
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
        return iterator, skip

    def val_every(self, total: int | float) -> int | float:
        """Validate every this many batches of an epoch of ``total`` (``val_check_interval``).

        Raises:
            ConfigurationError: an int interval longer than the epoch (where validation
                counts batches per epoch).
        """
        interval = self.trainer.val_check_interval
        if interval is None:
            return total
        if isinstance(interval, float):
            return max(1, int(total * interval))
        if interval > total and self.trainer.check_val_every_n_epoch is not None:
            raise ConfigurationError(
                f"val_check_interval={interval} is more than the {int(total)} training batches "
                "of an epoch, so validation would never run. Lower it, or pass "
                "check_val_every_n_epoch=None to count batches across epochs."
            )
        return interval

    def after_batch(self, batch_idx: int, val_every: int | float, val_loader: Any) -> bool:
        """Validate if it is due after ``batch_idx``; whether the epoch stops here (a
        stop was asked for and can be honoured, or ``max_steps`` is reached)."""
        trainer, state = self.trainer, self.state
        if val_loader is not None and self._should_validate(batch_idx, val_every):
            evaluate(trainer, state, "validate", val_loader)
            state.running = "train"
            state.metrics.stage = "train"
        stop = trainer.should_stop and self.can_stop_early()
        return stop or (trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps)

    def _should_validate(self, batch_idx: int, every: int | float) -> bool:
        """Lightning's rule: in a validating epoch, every ``every`` batches of the epoch
        (of the whole fit when ``check_val_every_n_epoch`` is None), and at a stop."""
        trainer = self.trainer
        every_n = trainer.check_val_every_n_epoch
        if not trainer.has_validation or (
            every_n is not None and (trainer.current_epoch + 1) % every_n
        ):
            return False
        if trainer.should_stop and self.can_stop_early():
            return True
        index = batch_idx if every_n is not None else self.total_batches - 1
        return (index + 1) % every == 0

    # ------------------------------------------------------------ the window
    def discard_window(self) -> None:
        """Drop the gradients of the current accumulation window on every optimizer."""
        state = self.state
        assert state.wrapped is not None
        for optimizer in state.optimizers:
            self.trainer.strategy.zero_grad(optimizer, state.wrapped)
        self.window_has_backward = False

    def preempt(self) -> None:
        """Save the preemption checkpoint and stop (every rank, at this step boundary)."""
        save_and_stop(self.trainer, self.preempt_ranks, self.signals.received)

    def warn_all_skipped(self) -> None:
        """Warn (once a process, on rank zero) that a whole epoch's ``training_step``
        returned None."""
        multi_rank = self.trainer.strategy.world_size > 1
        _WARNINGS.warn(
            "training_step returned None for every batch of an epoch"
            f"{' on at least one rank' if multi_rank else ''}, so nothing was trained. "
            "Return the loss (a tensor, or a dict with a 'loss' key); return None only "
            "to skip a batch on purpose.",
            category=UserWarning,
        )


def train_preparer(trainer: Trainer, state: RunState) -> Callable[[], None]:
    """What makes the fit's training loader from its source (``state.train_source``): this
    rank's share, ``overfit_batches`` applied, and the batch count."""
    source = state.train_source
    assert source is not None

    def prepare() -> None:
        loader = prepare_loader(
            source.load(),
            "train",
            trainer.strategy.distributed_sampler_kwargs,
            distributed_sampler=trainer.use_distributed_sampler,
            overfit=bool(trainer.overfit_batches),
        )
        state.train_loader = loader
        trainer.num_training_batches = num_batches(loader, trainer.limit_train_batches)
        state.prepare_train = None

    return prepare
