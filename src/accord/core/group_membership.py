"""`RegroupingCollective`: a torch.distributed group's members after a rank is lost.

The part of `accord.core.process_group.ProcessGroupCollective`'s life that starts once the
group exists: each member's heartbeat on the rendezvous store (`accord.core.liveness`),
which names the ranks a failed wait was on; a new group of the survivors (`regroup`); and a
replacement's way in (`join_running`). Who is in the new group is agreed through
`accord.core.regroup`; this module forms the group on what they agreed. The hooks a group
formation calls (`_prepare`, `_join`, `_adopt`, `_default_backend`) are declared here, and
an engine's collective overrides them.

torch.distributed is imported when a group is formed, not when this module is.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.core.backend_threads import LentTensors, settle_at_exit
from accord.core.connections import GroupConnections
from accord.core.liveness import Liveness, lost_ranks_error, members_prefix
from accord.core.membership import MemberCollective
from accord.core.regroup import Regrouped, Regrouping
from accord.core.rendezvous import client_store, init_group_on_prefix, rendezvous_timeout
from accord.core.rendezvous_address import Rendezvous
from accord.errors import AccordError, CollectiveError, is_communication_error

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RegroupingCollective"]


class RegroupingCollective(MemberCollective):
    """The base of `accord.core.process_group.ProcessGroupCollective` that keeps its
    members' heartbeats, forms a new group of the survivors of a lost rank and takes in a
    replacement. ``setup`` (in the subclass) fills in what the group met on."""

    timeout: timedelta
    _backend: str | None
    _group: ProcessGroup | None
    _lent: LentTensors

    def __init__(self) -> None:
        self.liveness: Liveness | None = None
        self._regrouping: Regrouping | None = None
        self._connections = GroupConnections()
        self._meeting: Rendezvous | None = None
        super().__init__()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a pickled strategy) holds no heartbeat thread, store or sockets of its own.
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        state.update(liveness=None, _regrouping=None, _connections=GroupConnections())
        return state

    # ---------------------------------------------------------------- liveness
    def _start_heartbeat(self, meeting: Rendezvous) -> None:
        """Keep this rank's heartbeat on the store the group met on (several ranks only)."""
        if meeting.world_size < 2:
            return
        self.liveness = Liveness(
            meeting.address,
            meeting.port,
            members_prefix(),
            meeting.rank,
            range(meeting.world_size),
        )
        self.liveness.start(lambda: self._progress())

    @override
    def diagnose(self, error: BaseException, where: str) -> AccordError | None:
        """Name who the failed wait was on: the ranks whose heartbeat stopped (dead or
        frozen: `RankFailureError`), else the ranks that are alive but elsewhere
        (`CollectiveTimeoutError`), with what every rank was doing."""
        liveness = self.liveness
        if liveness is None or not is_communication_error(error):
            return None
        return lost_ranks_error(liveness.survey(), self._rank, where, error)

    # ----------------------------------------------------------------- regroup
    @override
    def join_running(self) -> Regrouped:
        """As a replacement (``ACCORD_REJOIN=1``), at the training loop: leave the group of
        one `setup` made, ask the running group to take this rank in and join it once it
        has, at its next step boundary (`Regrouping.join`).

        Raises:
            CollectiveError: this process is no replacement (see `rejoining`).
            accord.core.regroup.Excluded: the run ended before it took this rank in.
            RankFailureError: no group took this rank in within the rendezvous timeout.
        """
        import torch.distributed as dist

        meeting = self._meeting
        if not self.rejoining or meeting is None:
            raise CollectiveError(f"{type(self).__name__} is not waiting to join a run.")
        dist.destroy_process_group()
        store = client_store(meeting.address, meeting.port)
        self._start_heartbeat(meeting)
        regrouping, joined = Regrouping.join(
            store, members_prefix(), meeting.rank, self.timeout, rendezvous_timeout()
        )
        rank = joined.rank_of(meeting.rank)
        self._prepare(rank)
        init_group_on_prefix(
            self._backend or self._default_backend(),
            store,
            regrouping.group_prefix(),
            meeting.address,
            meeting.port,
            rank,
            len(joined.members),
            self.timeout,
            self._connections,
        )
        self._join()
        self._regrouping, self.rejoining = regrouping, False
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        if self.liveness is not None:
            self.liveness.members = joined.members
            self.liveness.joins_handled = regrouping.joins_handled
        settle_at_exit()
        self._adopt()
        return joined

    @property
    @override
    def join_pending(self) -> bool:
        """Whether a replacement rank waits to be taken in (see `regroup`'s ``admit``)."""
        return self.liveness is not None and self.liveness.join_pending

    @property
    @override
    def can_regroup(self) -> bool:
        """Whether `regroup` works: this collective created the default group of several
        ranks on a shared rendezvous store (not under a user's ``init_method``)."""
        return self._regrouping is not None and self._group is None

    @property
    def member(self) -> int:
        """This process's member id: its rank when the group first formed."""
        return self._regrouping.member if self._regrouping is not None else self.rank

    @override
    def regroup(self, progress: dict[str, Any], admit: bool = False) -> Regrouped:
        """After a failed wait: drop the group, agree with the other survivors on who is
        left (`accord.core.regroup`), and form a new default group of them on a fresh key
        prefix. Every survivor must call it; ``progress`` is what this rank tells the
        others about itself (it comes back in the result). The rank and world size follow
        the new group.

        Raises:
            CollectiveError: this collective cannot regroup (see `can_regroup`).
            accord.core.regroup.Excluded: the others went on without this rank.
            RankFailureError: the rendezvous store is gone.
        """
        import torch.distributed as dist

        regrouping, meeting = self._regrouping, self._meeting
        if regrouping is None or meeting is None or self._group is not None:
            raise CollectiveError(
                f"{type(self).__name__} cannot regroup: only a group it created itself on "
                "the rendezvous store can (not one joined from a user's init_process_group "
                "or init_method, nor a sub-group)."
            )
        self._lent.collect()
        # Closing this rank's connections ends the others' waits on it at once.
        self._connections.sever()
        if dist.is_initialized():
            dist.destroy_process_group()
        regrouped = regrouping.agree(progress, admit)
        rank = regrouped.rank_of(regrouping.member)
        self._rank, self._world_size = rank, len(regrouped.members)
        self._prepare(rank)
        init_group_on_prefix(
            self._backend or self._default_backend(),
            regrouping.store,
            regrouping.group_prefix(),
            meeting.address,
            meeting.port,
            rank,
            len(regrouped.members),
            self.timeout,
            self._connections,
        )
        self._join()
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        if self.liveness is not None:
            self.liveness.members = regrouped.members
            self.liveness.joins_handled = regrouping.joins_handled
        self._adopt()
        return regrouped

    # ------------------------------------------------- hooks of a group formation
    def _default_backend(self) -> str:
        """The backend used when none was given: gloo, unless the engine knows better."""
        return "gloo"

    def _prepare(self, rank: int) -> None:
        """Run before the group is created or joined, with this process's rank."""

    def _join(self) -> None:
        """Adopt the default group that now exists (made by `setup` or by someone else)."""

    def _adopt(self) -> None:
        """Run once the group is ready (after `setup`, and after `regroup` made a new one):
        a subclass caches what its ops use of the group."""
