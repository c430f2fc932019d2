"""`ProcessGroupCollective`: the lifecycle of a collective on a torch.distributed process group.

Every collective whose ops run on a torch.distributed group (`TorchCollective`,
`DeepSpeedCollective`) shares the same life: ``setup()`` creates the default group, or
joins one that already exists (torchrun, a user's ``init_process_group``, another
collective) and records which; ``teardown()`` destroys only what ``setup()`` created, and
is idempotent. A subclass supplies its primitives and, where its engine needs them, the
hooks `_prepare`, `_join`, `_init_with_method` and `_destroy`.

What a new group needs comes from the modules beside this one: where it meets
(`accord.core.rendezvous_address`: the arguments, else ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``), the store it meets on (`accord.core.rendezvous`), how
long its ops may wait and what a backend timeout inside one becomes
(`accord.core.timeouts`: ``ACCORD_COLLECTIVE_TIMEOUT``, `BackendTimeouts`), and what keeps
an op's tensors alive until gloo's worker threads let go (`accord.core.backend_threads`;
``teardown()`` waits for that, so a process never aborts at exit over an op's tensors).

torch.distributed is imported when a group is set up, not when this module is.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import Self, override

from accord.core.backend_threads import LentTensors, settle_at_exit
from accord.core.connections import GroupConnections
from accord.core.liveness import Liveness, lost_ranks_error, members_prefix
from accord.core.membership import MemberCollective
from accord.core.regroup import Regrouped, Regrouping
from accord.core.rendezvous import init_group_on_prefix, init_group_on_shared_store
from accord.core.rendezvous_address import Rendezvous, find_rendezvous
from accord.core.timeouts import BackendTimeouts, as_timedelta, timeout_from_env
from accord.errors import AccordError, CollectiveError, ConfigurationError, is_communication_error

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["ProcessGroupCollective"]


class ProcessGroupCollective(MemberCollective):
    """Base of the collectives whose ops run on a torch.distributed process group.

    Args:
        backend: the torch.distributed backend; one of the subclass's `backends`, or None
            for the subclass's default.
        timeout: seconds (or a timedelta) an op may wait for the other ranks.
        init_method: a torch ``init_method`` URL; default: ``MASTER_ADDR:MASTER_PORT``.

    Raises:
        ConfigurationError: an unknown backend.
    """

    backends: ClassVar[tuple[str, ...]] = ("gloo", "nccl", "mpi")
    """The backends ``backend=`` accepts."""
    backend_kind: ClassVar[str] = "torch.distributed"
    """What an unknown backend is called in the error for it."""

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: timedelta | float | None = None,
        init_method: str | None = None,
    ) -> None:
        if backend is not None and backend not in self.backends:
            raise ConfigurationError(
                f"Unknown {self.backend_kind} backend {backend!r}; use one of {self.backends}."
            )
        self._backend = backend
        self.timeout = as_timedelta(timeout)
        self._init_method = init_method
        self._group: ProcessGroup | None = None
        self._lent = LentTensors()
        self._guards: dict[str, BackendTimeouts] = {}
        self.liveness: Liveness | None = None
        self._regrouping: Regrouping | None = None
        self._connections = GroupConnections()
        self._meeting: Rendezvous | None = None
        super().__init__()

    # ----------------------------------------------------------------- identity

    @property
    def backend(self) -> str:
        """The torch.distributed backend in use (or the one `setup` will use)."""
        if self._ready:
            import torch.distributed as dist

            return str(dist.get_backend(self._group))
        return self._backend or self._default_backend()

    @property
    def process_group(self) -> ProcessGroup:
        """The process group this collective's ops run on (the default group unless a
        subclass runs on a group of its own). Valid after `setup`."""
        self._require_setup("process_group")
        if self._group is not None:
            return self._group
        import torch.distributed as dist

        group = dist.group.WORLD
        if group is None:
            raise CollectiveError(f"{type(self).__name__}'s default process group is gone.")
        return group

    def _op(self, name: str) -> BackendTimeouts:
        """Around a primitive: the backend's timeout inside ``name`` as `CollectiveTimeoutError`.

        One guard per op name, made on first use and kept while the rank and the timeout
        stay what they were."""
        guard = self._guards.get(name)
        if guard is None or guard.rank != self._rank or guard.timeout is not self.timeout:
            guard = self._guards[name] = BackendTimeouts(name, self._rank, self.timeout)
        return guard

    def _lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as an op hands it to the backend: every tensor an op passes goes
        through here, and stays alive until the backend lets go of it."""
        return self._lent.lend(tensor)

    # ---------------------------------------------------------------- lifecycle
    @override
    def setup(
        self,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        main_address: str | None = None,
        main_port: int | None = None,
        **kwargs: Any,
    ) -> Self:
        """Create the default process group, or join the one that already exists.

        Arguments not given are read from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
        (default ``127.0.0.1``) and ``MASTER_PORT``. ``ACCORD_COLLECTIVE_TIMEOUT``, when
        set, replaces `timeout`. Calling it again is a no-op.

        Raises:
            ConfigurationError: rank, world size or port settings that cannot form a group,
                or an ``ACCORD_COLLECTIVE_TIMEOUT`` that is not a number.
            CollectiveError: this torch build has no torch.distributed.
        """
        if self._ready:
            return self
        if kwargs:
            raise TypeError(f"Unexpected setup() arguments: {sorted(kwargs)}.")
        import torch.distributed as dist

        if not dist.is_available():
            raise CollectiveError("This torch build has no torch.distributed support.")
        configured = timeout_from_env()
        if configured is not None:
            self.timeout = configured
        if dist.is_initialized():
            self._prepare(dist.get_rank())
            self._join()
            self._created = False
        else:
            meeting = self.rendezvous(rank, world_size, main_address, main_port)
            self._prepare(meeting.rank)
            backend = self._backend or self._default_backend()
            if meeting.init_method is not None:
                self._init_with_method(backend, meeting)
            else:
                store, prefix = init_group_on_shared_store(
                    backend,
                    meeting.address,
                    meeting.port,
                    meeting.rank,
                    meeting.world_size,
                    self.timeout,
                    self._connections,
                )
                self._join()
                self._start_heartbeat(meeting)
                self._meeting = meeting
                self._regrouping = Regrouping(
                    store,
                    prefix,
                    members_prefix(),
                    meeting.rank,
                    range(meeting.world_size),
                    self.timeout,
                )
            self._created = True
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        if self._world_size > 1:
            settle_at_exit()  # the backend's threads may hold Python objects at exit
        self._ready = True
        self._adopt()
        return self

    def _adopt(self) -> None:
        """Run once the group is ready (after `setup`, and after `regroup` made a new one):
        a subclass caches what its ops use of the group."""

    def rendezvous(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        main_address: str | None = None,
        main_port: int | None = None,
    ) -> Rendezvous:
        """Where a new group would meet: the arguments given, else the environment
        (`accord.core.rendezvous_address.find_rendezvous`).

        Raises:
            ConfigurationError: a non-integer variable, a rank outside the world, or a
                multi-rank world without a port.
        """
        return find_rendezvous(
            type(self).__name__, rank, world_size, main_address, main_port, self._init_method
        )

    @override
    def teardown(self) -> Self:
        """Destroy the process group if `setup` created it; a no-op when called again.

        First waits (at most 5 s) until the backend holds none of the tensors this
        collective's ops handed it: an asynchronous op nobody waited for finishes first.
        """
        if not self._ready:
            return self
        import torch.distributed as dist

        self._lent.collect()
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None
        self._regrouping = self._meeting = None
        if self._created and dist.is_initialized():
            self._destroy()
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

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
    def regroup(self, progress: dict[str, Any]) -> Regrouped:
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
        regrouped = regrouping.agree(progress)
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
        self._adopt()
        return regrouped

    # -------------------------------------------------------- hooks for engines
    def _default_backend(self) -> str:
        """The backend used when none was given: gloo, unless the engine knows better."""
        return "gloo"

    def _prepare(self, rank: int) -> None:
        """Run before the group is created or joined, with this process's rank."""

    def _join(self) -> None:
        """Adopt the default group that now exists (made by `setup` or by someone else)."""

    def _init_with_method(self, backend: str, meeting: Rendezvous) -> None:
        """Create the default group through ``meeting.init_method``."""
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=meeting.init_method,
            rank=meeting.rank,
            world_size=meeting.world_size,
            timeout=self.timeout,
        )

    def _destroy(self) -> None:
        """Destroy what `setup` created: this collective's own group, else the default one."""
        import torch.distributed as dist

        dist.destroy_process_group(self._group)
