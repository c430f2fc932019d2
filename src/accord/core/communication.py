"""The communication half of `Strategy`: its helpers, written once on its collective.

"Do all ranks agree?", "what is the mean over ranks?", "every rank's rows, even when their
counts differ": each is written here, once, on the primitives of ``self.collective``, so it
means the same on every engine. A strategy changes how they travel by changing its
collective, never by overriding these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from accord.core.autograd import all_gather_with_grad
from accord.core.buffers import all_gather_uneven
from accord.core.collective import Collective, ReduceOpLike
from accord.core.membership import MemberCollective
from accord.errors import AccordError, CollectiveError, ConfigurationError

if TYPE_CHECKING:
    from accord.core.regroup import Regrouped
    from accord.core.wrappers.stats import CollectiveStats

__all__ = ["StrategyCommunication"]

T = TypeVar("T")


class StrategyCommunication(ABC):
    """Communication helpers every `Strategy` has; see `Strategy` for the rest."""

    collective_stats: CollectiveStats | None
    membership: tuple[int, int] | None = None
    """This process's rank and the world size since a `regroup` (None before any): they
    hold after the run, and the next run's group is formed of the same ranks."""

    @property
    @abstractmethod
    def collective(self) -> Collective:
        """The strategy's collective (its wrappers included)."""

    @property
    @abstractmethod
    def base_collective(self) -> Collective:
        """The backend collective inside any wrappers."""

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    def reduce(self, tensor: torch.Tensor | float, op: ReduceOpLike = "mean") -> torch.Tensor:
        """Reduce ``tensor`` (or a number) over all ranks; the input is not modified."""
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.tensor(tensor, device=self.root_device)
        return self.collective.all_reduce(tensor, op)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank.

        A tensor travels as a tensor and must have the same shape and dtype on every rank;
        anything else is pickled.
        """
        if isinstance(obj, torch.Tensor):
            return self.collective.broadcast(obj, src)  # type: ignore[return-value]
        return self.collective.broadcast_object(obj, src)  # type: ignore[no-any-return]

    def all_gather(
        self, tensor: torch.Tensor, *, even: bool = False, sync_grads: bool = False
    ) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0, in rank order.

        First dimensions may differ between ranks (the tensors are padded to the longest,
        gathered, and trimmed); the other dimensions and the dtype must agree. A 0-d
        tensor counts as one element, so scalars gather to shape ``[world_size]``. Pass
        ``even=True`` when every rank's shape is known to be the same: it skips the
        exchange of lengths, so the gather is a single collective call. With
        ``sync_grads`` (``even`` only) the result carries gradients back to each rank's
        ``tensor``.

        Raises:
            ConfigurationError: ``sync_grads`` without ``even``.
        """
        if not sync_grads:
            return all_gather_uneven(self.collective.all_gather, tensor, even=even)
        if not even:
            raise ConfigurationError(
                "all_gather(sync_grads=True) needs tensors of one shape on every rank (even=True)."
            )
        stacked = all_gather_with_grad(self.collective, tensor.reshape(tensor.shape or (1,)))
        return stacked.reshape(-1, *stacked.shape[2:])

    def gather_collective_stats(self) -> list[dict[str, dict[str, float]]]:
        """Every rank's `collective_stats` summary, in rank order (every rank must call it).

        Gathered on the collective inside the statistics wrapper, so the report does not
        count itself.
        """
        summary = self.collective_stats.summary() if self.collective_stats is not None else {}
        gathered: list[dict[str, dict[str, float]]] = self.base_collective.all_gather_object(
            summary
        )
        return gathered

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank arrives."""
        self.collective.barrier(name)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on one boolean across ranks, with a single ``all_reduce(sum)``.

        Every rank contributes its ``decision`` as a one-element integer tensor and gets
        the same answer, so no rank leaves a loop on its own while the others wait.

        With ``all=True`` the result is True only when every rank said True; with
        ``all=False`` it is True when any rank did. Example: EarlyStopping on 4 ranks where
        only rank 2 wants to stop — ``all=True`` gives False on every rank, ``all=False``
        gives True on every rank.
        """
        collective = self.collective
        vote = torch.tensor([1 if decision else 0], dtype=torch.int32, device=self.root_device)
        total = int(collective.all_reduce(vote, "sum", out=vote).item())
        return total == collective.world_size if all else total > 0

    # ---------------------------------------------------------------- liveness
    def report_progress(self, describe: Callable[[], str]) -> None:
        """Tell the collective how to say what this rank is doing (``"step 140: train"``),
        for the error another rank raises when a wait on this one fails."""
        base = self.base_collective
        if isinstance(base, MemberCollective):
            base.report_progress(describe)

    @property
    def can_regroup(self) -> bool:
        """Whether the collective can go on without a lost rank (`regroup`)."""
        base = self.base_collective
        return isinstance(base, MemberCollective) and base.can_regroup

    def regroup(self, progress: dict[str, Any]) -> Regrouped:
        """After a failed wait: form a new group of the ranks left, through the
        collective (`accord.core.membership.MemberCollective.regroup`); every survivor
        calls it with what it tells the others about itself. `global_rank` and
        `world_size` follow the new group.

        Raises:
            CollectiveError: the collective cannot regroup.
            accord.core.regroup.Excluded: the others went on without this rank.
            RankFailureError: the rendezvous store is gone.
        """
        base = self.base_collective
        if not isinstance(base, MemberCollective):
            raise CollectiveError(
                f"{type(base).__name__} cannot go on without a lost rank: it keeps no "
                "membership of its own."
            )
        regrouped = base.regroup(progress)
        rank_zero_only.rank = base.rank  # type: ignore[attr-defined]
        self.membership = (base.rank, base.world_size)
        return regrouped

    def diagnose(self, error: BaseException, where: str) -> AccordError | None:
        """An error naming who a failed wait (``error``, at ``where`` on this rank) was on:
        the ranks that died or froze, or those alive elsewhere; None when the collective
        cannot tell, or ``error`` is no failed wait."""
        base = self.base_collective
        return base.diagnose(error, where) if isinstance(base, MemberCollective) else None
