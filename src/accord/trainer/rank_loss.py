"""``Trainer(on_rank_loss="continue")``: a data-parallel fit goes on without a lost rank.

When a wait on the other ranks fails inside a unit of training work, the survivors
regroup (`accord.core.regroup`: they agree through the rendezvous store on who is left
and form a new process group), and every survivor runs that unit again from its start:

* a **window** (the batches of one optimizer step, up to the step): dropped, and run
  again on the survivors, the same samples dealt over fewer ranks
  (`accord.trainer.dealing.window_loader`); each rank's loss is weighted so the step is the
  mean over the same global batch, as the full world's would be;
* the **after-work** of a committed step (the ``on_train_batch_end`` hooks, logging,
  validation, checkpoint saves, a preemption's save);
* the **epoch end** (its metrics, hooks and schedulers).

Each survivor tells the others where it is (`Position`). Where they differ (a rank died
half-way through the last gradient all-reduce, so some survivors completed the step and
others did not), every survivor takes the training state of the one furthest on (its
model, optimizers, schedulers, callbacks and counters, sent over the new group) and goes
on from its position. Nothing is lost: a step is taken once, with the gradient of the
whole global batch. What may run twice is a hook of the interrupted unit that ran before
the failure (``on_train_batch_end`` of a window's earlier batches, a save).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from accord.core.regroup import Excluded, Regrouped
from accord.core.wrappers.recorder import find_recorder
from accord.errors import ConfigurationError, RankFailureError, is_communication_error
from accord.log import rank_zero_warning
from accord.trainer.dealing import reshard, window_loader
from accord.trainer.training_checkpoints import adopt_state, checkpoint_state

if TYPE_CHECKING:
    from accord.core.strategy import Strategy
    from accord.trainer.state import RunState
    from accord.trainer.trainer import Trainer

__all__ = ["RANK_LOSS_MODES", "Position", "Survival", "check_rank_loss_mode"]

log = logging.getLogger(__name__)

RANK_LOSS_MODES = ("fail", "continue")
"""What ``Trainer(on_rank_loss=...)`` accepts."""

UNITS = ("after", "window", "epoch_end")
"""The units of work a survivor can be in, in the order they come for one step."""


def check_rank_loss_mode(mode: str, strategy: Strategy) -> str:
    """Return ``mode`` if it is one of `RANK_LOSS_MODES` that ``strategy`` can honour.

    Raises:
        ConfigurationError: an unknown mode, ``"continue"`` with a strategy that cannot
            go on without a rank (a sharded one, or a single process), or ``"fail"`` with a
            strategy told to restart lost ranks (``max_restarts``).
    """
    if mode not in RANK_LOSS_MODES:
        raise ConfigurationError(
            f"on_rank_loss={mode!r} is not known; use 'fail' (stop every rank and name the "
            "lost one) or 'continue' (go on without it)."
        )
    if mode == "continue" and not strategy.survives_rank_loss:
        raise ConfigurationError(
            f"on_rank_loss='continue' covers the DDP family (strategy='ddp', 'ddp_spawn', "
            f"'ddp_fork'), where every rank holds the whole training state; "
            f"{type(strategy).__name__} cannot go on without a rank (a sharded strategy "
            "keeps part of the state on each rank). Restart instead: run under torchrun "
            "--max-restarts N with a ModelCheckpoint; the restarted ranks resume from the "
            "newest checkpoint by themselves (Trainer(auto_resume=True), the default)."
        )
    restarts: object = getattr(strategy, "max_restarts", None)
    if mode == "fail" and isinstance(restarts, int) and restarts > 0:
        raise ConfigurationError(
            f"{type(strategy).__name__}(max_restarts={restarts}) starts a lost "
            "rank again to rejoin a run that goes on without it, which on_rank_loss='fail' "
            "(the default) never does: pass Trainer(on_rank_loss='continue'), or drop "
            "max_restarts."
        )
    return mode


@dataclass(frozen=True)
class Position:
    """Where a rank is in the fit when a wait fails: what it tells the other survivors.

    Attributes:
        epoch: `Trainer.current_epoch`.
        step: `Trainer.global_step`: the optimizer steps committed.
        unit: the unit of work in progress, one of `UNITS`.
        window_start: the index (in the epoch) of the first batch not yet stepped on.
        stage: how far the unit got: the after-work's stages done (see
            `accord.trainer.training_epoch.TrainingEpoch.after_batch`), else 0.
        window: the global batch: positions of the epoch's order one step takes.
    """

    epoch: int
    step: int
    unit: str
    window_start: int
    stage: int = 0
    window: int = 0

    def order(self) -> tuple[int, int, int, int]:
        """Later positions compare greater."""
        return (self.epoch, self.step, UNITS.index(self.unit), self.stage)


@dataclass(frozen=True)
class Resume:
    """Where every survivor goes on, after `Survival.recover`.

    Attributes:
        position: the unit every survivor runs from its start.
        adopted: this rank took another's state (it was behind).
    """

    position: Position
    adopted: bool


class Survival:
    """One fit's ability to go on without a lost rank (``on_rank_loss="continue"``).

    Args:
        trainer: the Trainer of the fit.
        state: its run state.
    """

    def __init__(self, trainer: Trainer, state: RunState) -> None:
        self.trainer = trainer
        self.state = state
        strategy = trainer.strategy
        self.start_world = strategy.world_size
        # Positions of the epoch's order one optimizer step's batch takes (the batch size
        # on every rank of the starting world): kept through every change.
        self.window: int | None = None
        # Each batch's loss weight from `window_start` on, after a change (else None).
        self.weights: list[float] | None = None
        self.weights_start = 0
        self.changes = 0

    def check_fit(self) -> None:
        """Refuse a fit this mode cannot carry through, before it starts.

        Raises:
            ConfigurationError: manual optimization, or a collective that cannot regroup.
        """
        trainer, module = self.trainer, self.state.module
        if module is not None and not module.automatic_optimization:
            raise ConfigurationError(
                "on_rank_loss='continue' needs automatic optimization: under manual "
                "optimization training_step takes its optimizer steps itself, so a step cut "
                "short by a lost rank cannot be dropped and taken again. Use "
                "on_rank_loss='fail', or automatic optimization."
            )
        strategy = trainer.strategy
        if strategy.world_size > 1 and not strategy.can_regroup:
            raise ConfigurationError(
                f"on_rank_loss='continue': {type(strategy.base_collective).__name__} cannot "
                "form a new group of the ranks left after a loss. It needs a group accord "
                "created on the rendezvous store (a TorchCollective, not one joined from "
                "your own init_process_group, nor a sub-group)."
            )

    def handles(self, error: BaseException) -> bool:
        """Whether ``error`` is a failed wait on the other ranks, which a regroup answers."""
        return (
            self.trainer.strategy.world_size > 1
            and not isinstance(error, (Excluded, RankFailureError))
            and is_communication_error(error)
        )

    def begin_epoch(self, loader: Any) -> None:
        """Note the global batch of the epoch that starts (the first epoch's sets it)."""
        if self.window is None:
            self.window = self.state.samples_per_batch
        if self.window is None or self.state.epoch_order is None:
            raise ConfigurationError(
                "on_rank_loss='continue' deals the samples of a lost rank to the others, "
                "which needs an order of samples accord can rebuild: a map-style dataset in "
                "a DataLoader with a batch size, shuffled by its RandomSampler or in order "
                "(not an IterableDataset, a custom sampler, or a loader with a generator "
                "of its own). Use on_rank_loss='fail' with such a loader."
            )

    # ----------------------------------------------------------------- recover
    def recover(self, error: BaseException, position: Position) -> Resume:
        """Regroup with the other survivors after ``error`` struck in ``position``'s unit;
        take the furthest survivor's state where they differ; wrap the module for the
        new group; shard validation over it. Returns where every survivor goes on.

        Raises:
            CollectiveTimeoutError: nobody was lost: the ranks are in different calls.
            accord.core.regroup.Excluded: the others went on without this rank.
            RankFailureError: the rendezvous store is gone.
        """
        strategy = self.trainer.strategy
        started, before = time.perf_counter(), strategy.world_size
        regrouped = strategy.regroup(asdict(self._stamped(position)))
        if not regrouped.lost:
            # Every rank is alive: a call only some ranks made (a bug), not a lost rank.
            named = strategy.diagnose(error, f"step {position.step}")
            raise (named or error) from error
        positions = {m: Position(**p) for m, p in regrouped.progress.items()}
        source = max(positions, key=lambda m: (positions[m].order(), -m))
        target = positions[source]
        member = regrouped.members[strategy.global_rank]
        adopted = positions[member] != target
        self._rebuild(regrouped, source, any(p != target for p in positions.values()))
        self._announce(regrouped, before, target, started)
        return Resume(target, adopted)

    def grow(self, position: Position) -> None:
        """At a step boundary, when the ranks agreed that a replacement waits to join:
        take it in (and anyone it brought along), wrap the module for the larger group, and
        give it the training state (`adopt_joined` is its side)."""
        strategy = self.trainer.strategy
        started, before = time.perf_counter(), strategy.world_size
        regrouped = strategy.regroup(asdict(self._stamped(position)), admit=True)
        old = [m for m in regrouped.members if m not in regrouped.joined]
        self._rebuild(regrouped, min(old), bool(regrouped.joined))
        self._announce(regrouped, before, position, started)

    def adopt_joined(self) -> None:
        """As a replacement for a lost rank (`Strategy.rejoining`), before its first batch:
        join the running group at its next step boundary, and take the training state and
        position it sends (`grow` is the group's side)."""
        state = self.state
        joined = self.trainer.strategy.join_running()
        source = min(m for m in joined.members if m not in joined.joined)
        target = Position(**joined.progress[source])
        self.window = target.window or None
        self._rebuild(joined, source, True)
        state.skip_batches = target.window_start

    def _stamped(self, position: Position) -> Position:
        """``position`` with this fit's global batch, which a replacement needs."""
        return replace(position, window=self.window or 0)

    def _rebuild(self, regrouped: Regrouped, source: int, share: bool) -> None:
        """After a regroup: the state of member ``source`` everywhere where ``share``,
        the module wrapped for the new group, validation sharded over it."""
        state, strategy = self.state, self.trainer.strategy
        if share:
            self._share_state(regrouped.rank_of(source))
        assert state.wrapped is not None
        state.wrapped = strategy.rewrap(state.wrapped)
        self._shard_validation()
        self.changes += 1

    def _share_state(self, source: int) -> None:
        """Every survivor takes the training state of rank ``source`` (the furthest on)."""
        trainer, state = self.trainer, self.state
        strategy = trainer.strategy
        mine = checkpoint_state(trainer, state) if strategy.global_rank == source else None
        theirs = strategy.broadcast(mine, src=source)
        if strategy.global_rank != source:
            assert theirs is not None
            adopt_state(trainer, state, theirs)

    def _shard_validation(self) -> None:
        """The validation loader sharded over the new group."""
        state, loop = self.state, self.state.fit_loop
        if loop is None or loop.val_loader is None:
            return
        loop.val_loader = state.val_loader = reshard(
            loop.val_loader, self.trainer.strategy.distributed_sampler_kwargs
        )

    def _announce(
        self, regrouped: Regrouped, before: int, target: Position, started: float
    ) -> None:
        """Say on rank 0 who was lost (and how) or taken in, and how the run goes on, and
        put the change in the collective's records (the regroup began at ``started``, a
        `time.perf_counter` value)."""
        what = [
            f"rank {m} "
            + (f"({regrouped.causes[m]}) " if m in regrouped.causes else "(stopped answering) ")
            + "lost"
            for m in regrouped.lost
        ] + [f"rank {m} rejoined" for m in regrouped.joined]
        batch = f"; global batch kept at {self.window}" if self.window else ""
        recorder = find_recorder(self.trainer.strategy.collective)
        if recorder is not None:  # the timeline and a hang's dump show the change
            members = ", ".join(map(str, regrouped.members))
            recorder.record_membership(f"{', '.join(what)}: members {members}", started)
        rank_zero_warning(
            log,
            "%s at step %d; continuing with %d ranks (%d before)%s (regrouped in %.1f s)",
            ", ".join(what),
            target.step,
            len(regrouped.members),
            before,
            batch,
            time.perf_counter() - started,
        )

    # -------------------------------------------------------------------- data
    def batches(self, loader: Any, start: int) -> Iterator[Any]:
        """This rank's batches of the current epoch from batch ``start`` on, each window
        of the epoch's order dealt over the ranks there are now (`window_loader`)."""
        state, strategy = self.state, self.trainer.strategy
        assert self.window is not None and state.epoch_order is not None
        consumed = state.epoch_samples_start + (start - state.epoch_batch_start) * self.window
        dealt, weights = window_loader(
            loader,
            state.epoch_order,
            consumed,
            self.window,
            strategy.world_size,
            strategy.global_rank,
        )
        state.epoch_samples_start, state.epoch_batch_start = consumed, start
        state.samples_per_batch = self.window
        state.batches_done = start
        self.weights, self.weights_start = weights, start
        return iter(dealt)

    def weight(self, batch_idx: int) -> float:
        """The loss weight of batch ``batch_idx`` (1 before any change)."""
        weights = self.weights
        if weights is None:
            return 1.0
        index = batch_idx - self.weights_start
        return weights[index] if 0 <= index < len(weights) else 1.0
