"""What the Trainer keeps between its parts, and what rank zero hands back to the launcher's caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accord.module import Module
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import SchedulerConfig

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
        epoch_schedulers_stepped: whether the current epoch's epoch-interval schedulers
            stepped; a checkpoint taken at the end of an epoch before they did (after
            validation) steps them on resume.
        resume_position: a mid-epoch checkpoint's data position (the epoch's global
            order, as `accord.trainer.data.epoch_order` records it, and the positions of
            it consumed), taken up when the next epoch starts.
        epoch_order: the current epoch's global order of samples, or None where accord
            cannot reproduce it.
        epoch_samples_start: positions of that order consumed before this run's iterator
            over the epoch began (not zero in an epoch resumed mid-way).
        epoch_batch_start: the index of that iterator's first batch.
        samples_per_batch: positions one batch on every rank consumes, or None.
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
    epoch_schedulers_stepped: bool = False
    resume_position: tuple[dict[str, Any], int] | None = None
    epoch_order: dict[str, Any] | None = None
    epoch_samples_start: int = 0
    epoch_batch_start: int = 0
    samples_per_batch: int | None = None

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
