"""`ProcessGroupCollective`: the lifecycle of a collective on a torch.distributed process group.

Every collective whose ops run on a torch.distributed group (`TorchCollective`,
`DeepSpeedCollective`) shares the same life: ``setup()`` creates the default group, or
joins one that already exists (torchrun, a user's ``init_process_group``, another
collective) and records which; the rank, world size and rendezvous address come from its
arguments or the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` environment; a new
group meets on one store per process (`init_group_on_shared_store`); ``teardown()``
destroys only what ``setup()`` created, and is idempotent. With ``ACCORD_COLLECTIVE_TIMEOUT``
set, a group ``setup()`` creates times its ops out after that many seconds, and a backend
timeout inside an op is raised as `CollectiveTimeoutError` (`BackendTimeouts`). A subclass supplies its
primitives and, where its engine needs them, the hooks `_prepare`, `_join`,
`_init_with_method` and `_destroy`.

The tensors an op hands to the backend go through `ProcessGroupCollective._lend`, which
keeps them until gloo's worker threads let go (`accord.core.lending`); ``teardown()`` waits
for that, so a process never aborts at exit over an op's tensors, and a process that set up
a group of several ranks leaves the GIL free for a moment at exit, for what else those
threads still hold (`accord.core.lending.settle_at_exit`).

torch.distributed is imported when a group is set up, not when this module is.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import Self, override

from accord.core.lending import LentTensors, settle_at_exit
from accord.core.membership import MemberCollective
from accord.core.rendezvous import init_group_on_shared_store
from accord.errors import CollectiveError, CollectiveTimeoutError, ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV_VAR",
    "ProcessGroupCollective",
    "Rendezvous",
    "as_timedelta",
    "BackendTimeouts",
    "byte_view",
    "timeout_from_env",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long an op may wait for the other ranks before it fails (torch's own default)."""

TIMEOUT_ENV_VAR = "ACCORD_COLLECTIVE_TIMEOUT"
"""Seconds; when set, the watchdog's wait and the op timeout of every group accord creates."""

# How gloo (and torch's own wait) say that an op ran out of time.
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def timeout_from_env() -> timedelta | None:
    """``ACCORD_COLLECTIVE_TIMEOUT`` as a timedelta; None when it is unset, empty or ``0``
    (negative values count as off too).

    Raises:
        ConfigurationError: the variable is not a number of seconds.
    """
    raw = os.environ.get(TIMEOUT_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ConfigurationError(
            f"{TIMEOUT_ENV_VAR}={raw!r} is not a number of seconds; use e.g. 300, or 0 for off."
        ) from None
    return timedelta(seconds=seconds) if seconds > 0 else None


class BackendTimeouts:
    """A context manager that raises a backend's own timeout inside ``op`` as
    `CollectiveTimeoutError` naming ``op``; other errors pass through unchanged.

    Every rank may have called ``op`` and still not finish it: gloo waits for bytes a rank
    with a different shape never sends. A class rather than a generator, so that a
    collective keeps one per op and entering it costs two plain method calls.

    Args:
        op: the operation's public name, for the message.
        rank: this rank, for the message.
        timeout: the group's op timeout, for the message.
    """

    __slots__ = ("op", "rank", "timeout")

    def __init__(self, op: str, rank: int, timeout: timedelta) -> None:
        self.op = op
        self.rank = rank
        self.timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, _: Any) -> None:
        if err is not None:
            self.raise_timeout(err)

    def raise_timeout(self, err: BaseException) -> None:
        """Raise ``err`` as `CollectiveTimeoutError` if it is the backend's timeout; return
        otherwise (the caller re-raises it as it is). For a hot path that catches the
        backend's error itself instead of entering the guard."""
        if not isinstance(err, RuntimeError) or isinstance(err, CollectiveError):
            return
        if not _TIMED_OUT.search(str(err)):
            return
        raise CollectiveTimeoutError(
            f"Rank {self.rank}: {self.op} did not complete within the process group's timeout "
            f"of {self.timeout.total_seconds():g} s. Either a rank never called it, or the ranks "
            "called it with different shapes, dtypes or roots (the backend then waits for "
            "data that never comes), or a rank stopped inside it. Run with "
            f"ACCORD_DEBUG_COLLECTIVES=1 to compare every call across ranks. The backend "
            f"said: {err}",
            op=self.op,
            rank=self.rank,
        ) from err


def as_timedelta(timeout: timedelta | float | None) -> timedelta:
    """``timeout`` (seconds or a timedelta; None: `DEFAULT_TIMEOUT`) as a positive timedelta.

    Raises:
        TypeError: neither a number nor a timedelta.
        ValueError: zero or negative.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {timeout!r}.")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value}.")
    return value


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the buffer a data-movement op sends: bool as uint8 of the same size.

    Broadcast, gather and the other ops that only copy bytes accept every dtype this way;
    bool is not a gloo type.
    """
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


@dataclass(frozen=True)
class Rendezvous:
    """How a new default group meets: this rank, the world size, and where.

    Attributes:
        rank: this process's rank in the new group.
        world_size: the number of ranks.
        address: the host that serves the rendezvous store (rank 0's).
        port: its port (-1 when ``init_method`` replaces it).
        init_method: a torch ``init_method`` URL that replaces ``address:port``, or None.
    """

    rank: int
    world_size: int
    address: str
    port: int
    init_method: str | None = None


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
                init_group_on_shared_store(
                    backend,
                    meeting.address,
                    meeting.port,
                    meeting.rank,
                    meeting.world_size,
                    self.timeout,
                )
                self._join()
            self._created = True
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        if self._world_size > 1:
            settle_at_exit()  # the backend's threads may hold Python objects at exit
        self._ready = True
        return self

    def rendezvous(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        main_address: str | None = None,
        main_port: int | None = None,
    ) -> Rendezvous:
        """Where a new group would meet: the arguments given, else the environment.

        With no port given or set and a world of one, a free port is picked.

        Raises:
            ConfigurationError: a non-integer variable, a rank outside the world, or a
                multi-rank world without a port.
        """
        rank = _env_int("RANK", rank, default=0)
        world_size = _env_int("WORLD_SIZE", world_size, default=1)
        if not 0 <= rank < world_size:
            raise ConfigurationError(
                f"rank={rank} is outside [0, world_size={world_size}). Check RANK/WORLD_SIZE."
            )
        address = main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self._init_method is not None:
            return Rendezvous(rank, world_size, address, -1, self._init_method)
        port = main_port if main_port is not None else _env_int("MASTER_PORT", None, default=-1)
        if port < 0:
            if world_size > 1:
                raise ConfigurationError(
                    f"{type(self).__name__}.setup() needs a port for a multi-rank group: set "
                    "MASTER_PORT or pass main_port= (every rank must use the same one)."
                )
            from accord.environments.local import find_free_port

            port = find_free_port()
        return Rendezvous(rank, world_size, address, port)

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
        if self._created and dist.is_initialized():
            self._destroy()
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

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


def _env_int(name: str, value: int | None, *, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"Environment variable {name}={raw!r} is not an integer."
        ) from None
