"""What the Trainer keeps between its parts, and what rank zero hands back to the launcher's caller."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accord.module import Module
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import SchedulerConfig

if TYPE_CHECKING:
    from accord.module_optimization import StrategyOptimizer
    from accord.trainer.fit_loop import FitLoop
    from accord.trainer.hooks import RunHooks
    from accord.trainer.rank_loss import Survival
    from accord.trainer.sources import LoaderSource

__all__ = ["RankZeroResults", "RunState"]


@dataclass
class RunState:
    """The Trainer's working state, shared by its loops and its checkpointing.

    Attributes:
        module: the user's module of the current (or last) run.
        wrapped: the module as the strategy wrapped it; None outside a run.
        metrics: what ``self.log`` recorded in the current (or last) run.
        optimizers: the optimizers of the current (or last) fit.
        schedulers: their LR schedulers.
        batches_done: training batches of the current epoch already run.
        skip_batches: batches the next epoch skips: a mid-epoch checkpoint's position.
        rng_epoch_start: the RNG state when the current epoch's batches were drawn.
        resume_rng: a resumed checkpoint's RNG states (at its epoch's start, or None, and
            at the save), put back when the next epoch starts.
        epoch_schedulers_stepped: the epoch-interval schedulers (by ``id``) that stepped
            in the current epoch; a checkpoint taken at the end of an epoch before the
            others did (the monitored ones step after ``on_train_epoch_end``) steps them on
            resume.
        resume_position: a mid-epoch checkpoint's data position (the epoch's global
            order, as `accord.trainer.data.epoch_order` records it, and the positions of
            it consumed), taken up when the next epoch starts.
        epoch_order: the current epoch's global order of samples, or None where accord
            cannot reproduce it.
        epoch_samples_start: positions of that order consumed before this run's iterator
            over the epoch began (not zero in an epoch resumed mid-way).
        epoch_batch_start: the index of that iterator's first batch.
        samples_per_batch: positions one batch on every rank consumes, or None.
        running: what runs now: ``"train"``, ``"validate"``, ``"sanity_check"``,
            ``"test"``, ``"predict"``, or None between runs.
        interrupted: the last run ended with an exception.
        received_sigterm: this rank received SIGTERM during the fit.
        ckpt_path: the checkpoint the run restored, or None.
        is_last_batch: the training batch running is the epoch's last.
        train_loader: the fit's training loader as this rank uses it (None until known).
        val_loader: the run's validation loader as this rank uses it.
        eval_loaders: the test and predict loaders as this rank uses them, by stage.
        eval_batches: batches per loader of each evaluation stage (the sanity check's
            under ``"sanity_check"``).
        prepare_train: makes `train_loader` (and the batch count) when called, until the
            fit loop or `Trainer.estimated_stepping_batches` did.
        train_source: where the fit's training loader comes from.
        survival: how the fit goes on without a lost rank (``on_rank_loss="continue"``
            with several ranks), else None.
        fit_loop: the fit loop running, or None.
        last_loss: the loss of the last training batch that counted (None: skipped).
        hooks: the run's resolved hooks.
        step_optimizers: the optimizers as the hooks and ``Module.optimizers`` hand them
            out (their ``step`` and ``zero_grad`` go through the strategy).
        verbose: print the metrics of a validate/test run on rank zero.
    """

    module: Module | None = None
    wrapped: nn.Module | None = None
    metrics: MetricStore = field(default_factory=MetricStore)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[SchedulerConfig] = field(default_factory=list)
    batches_done: int = 0
    skip_batches: int = 0
    rng_epoch_start: torch.Tensor | None = None
    resume_rng: tuple[torch.Tensor | None, torch.Tensor] | None = None
    epoch_schedulers_stepped: set[int] = field(default_factory=set)
    resume_position: tuple[dict[str, Any], int] | None = None
    epoch_order: dict[str, Any] | None = None
    epoch_samples_start: int = 0
    epoch_batch_start: int = 0
    samples_per_batch: int | None = None
    running: str | None = None
    interrupted: bool = False
    received_sigterm: bool = False
    ckpt_path: str | None = None
    is_last_batch: bool = False
    train_loader: Any = None
    val_loader: Any = None
    eval_loaders: dict[str, Any] = field(default_factory=dict)
    eval_batches: dict[str, list[int]] = field(default_factory=dict)
    prepare_train: Callable[[], None] | None = None
    train_source: LoaderSource | None = None
    fit_loop: FitLoop | None = None
    last_loss: torch.Tensor | None = None
    hooks: RunHooks | None = None
    step_optimizers: list[StrategyOptimizer] = field(default_factory=list)
    verbose: bool = True
    survival: Survival | None = None

    def samples_consumed(self) -> int | None:
        """Positions of the current epoch's global order consumed so far, on all ranks
        together (None where the order is unknown)."""
        if self.epoch_order is None or self.samples_per_batch is None:
            return None
        done = self.batches_done - self.epoch_batch_start
        consumed = self.epoch_samples_start + done * self.samples_per_batch
        return min(consumed, int(self.epoch_order["length"]))


@dataclass
class RankZeroResults:
    """What a run on local rank zero sends to the process that launched the ranks.

    When the ranks are new processes (``ddp_spawn``, ``ddp_fork``, XLA), the launching
    process does not train; `Trainer.apply_rank_zero_results` takes this into its own
    objects, so the caller's model holds the trained weights afterwards.

    Attributes:
        output: what the run returned (the metrics of ``validate``/``test``, the
            predictions of ``predict``, None for ``fit``).
        state_dict: the trained module's weights, on the CPU.
        callback_metrics: `Trainer.callback_metrics`.
        progress_bar_metrics: `Trainer.progress_bar_metrics`.
        logged_metrics: `Trainer.logged_metrics`.
        callbacks: each callback's ``state_dict()``, by its ``state_key``.
        current_epoch: `Trainer.current_epoch`.
        global_step: `Trainer.global_step`.
        collective_stats_by_rank: `Trainer.collective_stats_by_rank`.
        membership: the rank and world size the run ended with, where ranks were lost
            (`accord.core.strategy.Strategy.membership`), else None.
    """

    output: Any
    state_dict: dict[str, torch.Tensor]
    callback_metrics: dict[str, torch.Tensor]
    progress_bar_metrics: dict[str, float]
    logged_metrics: dict[str, float]
    callbacks: dict[str, dict[str, Any]]
    current_epoch: int
    global_step: int
    collective_stats_by_rank: list[dict[str, dict[str, float]]]
    membership: tuple[int, int] | None = None
