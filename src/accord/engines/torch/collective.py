"""`TorchCollective`: the collective on `torch.distributed` (gloo, nccl, mpi)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, ReduceOp
from accord.errors import CollectiveError, CollectiveTimeoutError, ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_RENDEZVOUS_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "TorchCollective",
    "default_torch_backend",
    "rendezvous_timeout",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long an op may wait for the other ranks before it fails (torch's own default)."""

DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
"""How long the ranks wait for each other when a group is created (torchrun's join timeout)."""

_RENDEZVOUS_VARIABLE = "ACCORD_RENDEZVOUS_TIMEOUT"

_BACKENDS = ("gloo", "nccl", "mpi")


def default_torch_backend(device: torch.device | None = None) -> str:
    """``nccl`` for CUDA devices when it is available, else ``gloo``."""
    import torch.distributed as dist

    is_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return "nccl" if is_cuda and dist.is_nccl_available() else "gloo"


def _as_timedelta(timeout: timedelta | float | None) -> timedelta:
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


class TorchCollective(Collective):
    """Collective on `torch.distributed`.

    ``setup()`` creates the default process group when none exists (from its arguments or
    the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` environment) or joins the
    existing one; ``teardown()`` destroys the group only if this instance created it.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default: nccl on CUDA, else gloo.
        timeout: seconds (or a timedelta) an op may wait for the other ranks.
        init_method: a torch ``init_method`` URL; default: ``tcp://MASTER_ADDR:MASTER_PORT``.
    """

    backend_name = "torch.distributed"

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: timedelta | float | None = None,
        init_method: str | None = None,
    ) -> None:
        if backend is not None and backend not in _BACKENDS:
            raise ConfigurationError(
                f"Unknown torch.distributed backend {backend!r}; use one of {_BACKENDS}."
            )
        self._backend = backend
        self.timeout = _as_timedelta(timeout)
        self._init_method = init_method
        self._group: ProcessGroup | None = None
        self._ready = False
        self._created = False
        self._rank = -1
        self._world_size = -1

    # ----------------------------------------------------------------- lifecycle
    @property
    @override
    def rank(self) -> int:
        self._require_setup("rank")
        return self._rank

    @property
    @override
    def world_size(self) -> int:
        self._require_setup("world_size")
        return self._world_size

    @property
    @override
    def is_setup(self) -> bool:
        return self._ready

    @property
    @override
    def created_group(self) -> bool:
        return self._created

    @property
    def backend(self) -> str:
        """The torch.distributed backend in use (or that `setup` will use)."""
        if self._ready:
            import torch.distributed as dist

            return str(dist.get_backend(self._group))
        return self._backend or default_torch_backend()

    @property
    def group(self) -> ProcessGroup | None:
        """The process group ops run on (None: the default group)."""
        return self._group

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
        (default ``127.0.0.1``) and ``MASTER_PORT``. Calling it again is a no-op.
        """
        if self._ready:
            return self
        import torch.distributed as dist

        if not dist.is_available():
            raise CollectiveError("This torch build has no torch.distributed support.")
        if kwargs:
            raise TypeError(f"Unexpected setup() arguments: {sorted(kwargs)}.")
        if dist.is_initialized():
            self._created = False
        else:
            self._init_default_group(rank, world_size, main_address, main_port)
            self._created = True
        self._ready = True
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        self._native_mean = _averages_natively(self.backend)
        return self

    def _init_default_group(
        self,
        rank: int | None,
        world_size: int | None,
        main_address: str | None,
        main_port: int | None,
    ) -> None:
        import torch.distributed as dist

        rank = _env_int("RANK", rank, default=0)
        world_size = _env_int("WORLD_SIZE", world_size, default=1)
        if not 0 <= rank < world_size:
            raise ConfigurationError(
                f"rank={rank} is outside [0, world_size={world_size}). Check RANK/WORLD_SIZE."
            )
        backend = self._backend or default_torch_backend()
        if self._init_method is not None:
            dist.init_process_group(
                backend,
                init_method=self._init_method,
                rank=rank,
                world_size=world_size,
                timeout=self.timeout,
            )
            return
        address = main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = main_port if main_port is not None else os.environ.get("MASTER_PORT")
        if port is None:
            if world_size > 1:
                raise ConfigurationError(
                    "TorchCollective.setup() needs a port for a multi-rank group: set "
                    "MASTER_PORT or pass main_port= (every rank must use the same one)."
                )
            from accord.environments.local import find_free_port

            port = find_free_port()
        init_group_on_shared_store(backend, address, int(port), rank, world_size, self.timeout)

    @override
    def teardown(self) -> Self:
        if not self._ready:
            return self
        import torch.distributed as dist

        if self._created and dist.is_initialized():
            if self._group is None:
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(self._group)
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

    def new_subgroup(self, ranks: list[int]) -> TorchCollective | None:
        """Create a sub-group of ``ranks`` (global ranks) as a collective of its own.

        Every rank of this collective must call it. Returns the new collective on the
        members (it destroys the sub-group at teardown) and None on the other ranks.
        """
        self._require_setup("new_subgroup")
        import torch.distributed as dist

        members = sorted(set(ranks))
        if not members or members[0] < 0 or members[-1] >= self._world_size:
            raise ValueError(f"Sub-group ranks must lie in [0, {self._world_size}), got {ranks}.")
        group = dist.new_group(members, timeout=self.timeout)
        if self._rank not in members:
            return None
        child = TorchCollective(self._backend, timeout=self.timeout)
        child._group = group
        child._ready = child._created = True
        child._rank = dist.get_rank(group)
        child._world_size = dist.get_world_size(group)
        child._native_mean = _averages_natively(child.backend)
        return child

    @property
    @override
    def object_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---------------------------------------------------------------- primitives
    def _global(self, rank: int) -> int:
        if self._group is None:
            return rank
        import torch.distributed as dist

        return dist.get_global_rank(self._group, rank)

    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        import torch.distributed as dist

        dist.all_reduce(buffer, op=_torch_op(op), group=self._group)

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        dist.broadcast(_bytes_view(buffer), src=self._global(src), group=self._group)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        # The *_single ops (torch >= 2.13) replace the deprecated *_into_tensor names.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(_bytes_view(output).view(-1), _bytes_view(tensor).view(-1), group=self._group)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        import torch.distributed as dist

        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(output.view(-1), tensor.view(-1), op=_torch_op(op), group=self._group)

    @override
    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._group)

    @override
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(_bytes_view(tensor), dst=self._global(dst), group=self._group)

    @override
    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        dist.recv(_bytes_view(buffer), src=self._global(src), group=self._group)

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        rows = list(_bytes_view(output).unbind(0)) if output is not None else None
        dist.gather(_bytes_view(tensor), rows, dst=self._global(dst), group=self._group)

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        import torch.distributed as dist

        rows = list(_bytes_view(tensor).unbind(0)) if tensor is not None else None
        dist.scatter(_bytes_view(output), rows, src=self._global(src), group=self._group)

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_to_all_single(_bytes_view(output), _bytes_view(tensor), group=self._group)


def rendezvous_timeout() -> timedelta:
    """How long a new group waits for all its ranks: ``ACCORD_RENDEZVOUS_TIMEOUT`` seconds,
    else `DEFAULT_RENDEZVOUS_TIMEOUT`.

    Apart from the op timeout: a node that never starts must not keep the others waiting
    for the 30 minutes an op may take.
    """
    raw = os.environ.get(_RENDEZVOUS_VARIABLE)
    if raw is None or not raw.strip():
        return DEFAULT_RENDEZVOUS_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigurationError(
            f"{_RENDEZVOUS_VARIABLE}={raw!r} must be a positive number of seconds."
        )
    return timedelta(seconds=seconds)


_STORES: dict[tuple[str, int], tuple[Any, int]] = {}


def _rendezvous_store(address: str, port: int, host: bool, timeout: timedelta) -> tuple[Any, int]:
    """The process's store for ``address:port`` and the number of this group on it.

    Rank 0 serves the store for the life of the process, and every group made on it gets
    a fresh key prefix. So fit, then test, in one script never re-binds the port while
    the previous group's sockets are closing; every rank makes its groups in the same
    order, so the numbers agree.
    """
    import torch.distributed as dist

    key = (address, port)
    store, generation = _STORES.get(key, (None, -1))
    if store is None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            address, port, is_master=host, timeout=timeout, wait_for_workers=False
        )
    else:
        store.set_timeout(timeout)
    _STORES[key] = (store, generation + 1)
    return store, generation + 1


_TORCH_OPS: dict[ReduceOp, Any] = {}


def init_group_on_shared_store(
    backend: str, address: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> None:
    """Create the default process group on this process's store for ``address:port``.

    The ranks first wait for each other on the store, at most `rendezvous_timeout()`; a
    rank that cannot reach the store, or ranks that never arrive, end the wait with a
    `CollectiveTimeoutError` naming the address and the missing ranks. ``timeout`` then
    bounds every op of the group.
    """
    import torch.distributed as dist

    wait = rendezvous_timeout()
    try:
        store, generation = _rendezvous_store(address, port, rank == 0, wait)
    except dist.DistNetworkError as err:
        if rank == 0:  # rank 0 serves the store: it could not listen there
            raise
        raise CollectiveTimeoutError(
            f"Rank {rank} could not reach the rendezvous at {address}:{port} within "
            f"{_seconds(wait)}: nothing answered there. Rank 0 (on node 0) serves it; start "
            "node 0 with the same MASTER_ADDR and MASTER_PORT, and check that this machine "
            f"can reach that address and port. {_WAIT_LONGER}",
            op="rendezvous",
            rank=rank,
            missing_ranks=[0],
        ) from err
    group_store = dist.PrefixStore(f"accord/{generation}/", store)  # type: ignore[attr-defined]
    _wait_for_every_rank(group_store, address, port, rank, world_size, wait)
    # From here on the store serves the group's own traffic (gloo's connections, sub-groups),
    # which may wait as long as an op.
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=group_store, rank=rank, world_size=world_size, timeout=timeout
    )


_WAIT_LONGER = f"To wait longer, set {_RENDEZVOUS_VARIABLE} (seconds)."


def _seconds(value: timedelta) -> str:
    return f"{value.total_seconds():g} s"


def _wait_for_every_rank(
    store: Any, address: str, port: int, rank: int, world_size: int, wait: timedelta
) -> None:
    """Check in on ``store`` and return when every rank has, or raise after ``wait``."""
    import torch.distributed as dist

    store.set(f"arrived/{rank}", "1")
    # The last rank to arrive opens the gate, so each rank waits on one key, not world_size.
    if store.add("arrived", 1) == world_size:
        store.set("all_arrived", "1")
    try:
        store.wait(["all_arrived"], wait)
    except dist.DistError as err:
        missing = _missing_ranks(store, world_size)
        if missing:
            ranks = "rank" if len(missing) == 1 else "ranks"
            who = f"{ranks} {', '.join(map(str, missing))} of {world_size} did not arrive"
        else:
            who = f"not every one of the {world_size} ranks arrived"
        raise CollectiveTimeoutError(
            f"Rank {rank} gave up waiting at the rendezvous at {address}:{port}: {who} within "
            f"{_seconds(wait)}. Check that every node was started, with its own NODE_RANK and "
            "the same MASTER_ADDR and MASTER_PORT, and that the other machines can reach "
            f"this address and port. {_WAIT_LONGER}",
            op="rendezvous",
            rank=rank,
            missing_ranks=missing,
        ) from err


def _missing_ranks(store: Any, world_size: int) -> list[int]:
    """The ranks that have not checked in (empty when the store cannot be asked)."""
    import torch.distributed as dist

    try:
        return [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
    except dist.DistError:
        return []  # rank 0, which serves the store, has gone


def _averages_natively(backend: str) -> bool:
    """Whether every device backend in ``backend`` (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    implements ``ReduceOp.AVG`` for floating-point tensors (MPI and UCC do not)."""
    return {part.rpartition(":")[2] for part in backend.split(",")} <= {"gloo", "nccl"}


def _torch_op(op: ReduceOp) -> Any:
    if not _TORCH_OPS:  # built on first use: torch.distributed is imported lazily
        import torch.distributed as dist

        _TORCH_OPS.update(
            {
                ReduceOp.SUM: dist.ReduceOp.SUM,
                ReduceOp.MEAN: dist.ReduceOp.AVG,
                ReduceOp.MAX: dist.ReduceOp.MAX,
                ReduceOp.MIN: dist.ReduceOp.MIN,
                ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            }
        )
    return _TORCH_OPS[op]


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    # Data-movement ops only copy bytes; bool is not a gloo type, uint8 of the same size is.
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _env_int(name: str, value: int | None, *, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"Environment variable {name}={raw!r} is not an integer."
        ) from None
