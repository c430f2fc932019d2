"""`ProcessGroupCollective`: the lifecycle of a collective on a torch.distributed process group.

Every collective whose ops run on a torch.distributed group (`TorchCollective`,
`DeepSpeedCollective`) shares the same life: ``setup()`` creates the default group, or
joins one that already exists (torchrun, a user's ``init_process_group``, another
collective) and records which; ``teardown()`` destroys only what ``setup()`` created, and
is idempotent. A subclass supplies its primitives and, where its engine needs them, the
hooks `_prepare`, `_join`, `_init_with_method` and `_destroy`. What comes once the group
exists (the members' heartbeats, a new group of the survivors of a lost rank, a
replacement's join) is its base's, `accord.core.group_membership.RegroupingCollective`.

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

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import Self, override

from accord.core.backend_threads import LentTensors, settle_at_exit
from accord.core.group_membership import RegroupingCollective
from accord.core.liveness import members_prefix
from accord.core.regroup import REJOIN_ENV_VAR, Regrouping
from accord.core.rendezvous import init_group_on_shared_store
from accord.core.rendezvous_address import Rendezvous, find_rendezvous
from accord.core.timeouts import BackendTimeouts, as_timedelta, timeout_from_env
from accord.errors import CollectiveError, ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["ProcessGroupCollective"]


class ProcessGroupCollective(RegroupingCollective):
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
            elif os.environ.pop(REJOIN_ENV_VAR, None) == "1":
                self._start_alone(backend, meeting)
            else:
                self._create_on_shared_store(backend, meeting)
            self._created = True
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        if self._world_size > 1:
            settle_at_exit()  # the backend's threads may hold Python objects at exit
        self._ready = True
        self._adopt()
        return self

    def _start_alone(self, backend: str, meeting: Rendezvous) -> None:
        """As a replacement for a lost rank: a group of one, until `join_running`."""
        import torch.distributed as dist

        # A replacement works alone until it reaches the training loop
        # (`join_running`): what ranks do before it (setup hooks, wrapping the
        # module) must not meet the running group's collectives.
        alone = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=alone, rank=0, world_size=1, timeout=self.timeout)
        self._join()
        self._meeting, self.rejoining = meeting, True

    def _create_on_shared_store(self, backend: str, meeting: Rendezvous) -> None:
        """Create the default group on the store every collective of this process meets on,
        with this rank's heartbeat and what a `regroup` needs."""
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
        if meeting.rank == 0:
            self._regrouping.publish()

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
        if self._regrouping is not None and self._rank == 0:
            self._regrouping.close()
        self._regrouping = self._meeting = None
        self.rejoining = False
        if self._created and dist.is_initialized():
            self._destroy()
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

    # -------------------------------------------------------- hooks for engines
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
