"""`DeepSpeedCollective`: the collective on `deepspeed.comm`.

DeepSpeed is imported only when the collective is set up or used, so ``import accord``
(and importing this module) never imports it. ``deepspeed.comm`` wraps the default
torch.distributed group, so this collective either creates that group through
``deepspeed.init_distributed`` or lets DeepSpeed wrap one that already exists (made by
torchrun, a user's ``init_process_group`` or another collective).
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, ReduceOp
from accord.engines.torch.collective import (
    _as_timedelta,
    _bytes_view,
    _env_int,
    init_group_on_shared_store,
)
from accord.errors import CollectiveError, ConfigurationError, MissingDependencyError

__all__ = ["DeepSpeedCollective"]

_BACKENDS = ("gloo", "nccl", "mpi", "ccl", "hccl")


def _missing() -> MissingDependencyError:
    return MissingDependencyError("DeepSpeedCollective", "deepspeed", "deepspeed")


def _import(name: str) -> ModuleType:
    """Import ``name`` from deepspeed, or say how to install deepspeed."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise _missing() from err


def _import_deepspeed() -> ModuleType:
    """The ``deepspeed`` package, with its ``comm`` package loaded."""
    _import("deepspeed.comm")
    return _import("deepspeed")


def _ds_comm() -> ModuleType:
    """The ``deepspeed.comm`` module."""
    return _import("deepspeed.comm")


def _default_backend() -> str:
    """gloo on CPU; on an accelerator, the communication backend DeepSpeed picks for it."""
    accelerator = _import("deepspeed.accelerator").get_accelerator()
    if accelerator.device_name() == "cpu":
        return "gloo"
    return str(accelerator.communication_backend_name())


class DeepSpeedCollective(Collective):
    """Collective on `deepspeed.comm`.

    ``setup()`` creates the default process group with ``deepspeed.init_distributed``
    when none exists (from its arguments or the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT`` environment), or has DeepSpeed wrap the existing one;
    ``teardown()`` destroys the group only if this instance created it. Every primitive,
    ``send``/``recv``, ``gather``/``scatter`` and ``all_to_all`` included, runs through
    ``deepspeed.comm``.

    Args:
        backend: the torch.distributed backend DeepSpeed uses (``"gloo"``, ``"nccl"``,
            ``"mpi"``, ``"ccl"``, ``"hccl"``); default: gloo on CPU, else the
            accelerator's own (nccl on CUDA).
        timeout: seconds (or a timedelta) an op may wait for the other ranks.
        init_method: a torch ``init_method`` URL; default: ``tcp://MASTER_ADDR:MASTER_PORT``.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        ConfigurationError: an unknown backend.
    """

    backend_name = "deepspeed.comm"

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: timedelta | float | None = None,
        init_method: str | None = None,
    ) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise _missing()
        if backend is not None and backend not in _BACKENDS:
            raise ConfigurationError(
                f"Unknown DeepSpeed communication backend {backend!r}; use one of {_BACKENDS}."
            )
        self._backend = backend
        self.timeout = _as_timedelta(timeout)
        self._init_method = init_method
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
        """The torch.distributed backend under deepspeed.comm (or the one `setup` will use)."""
        if self._ready:
            import torch.distributed as dist

            return str(dist.get_backend())
        return self._backend or _default_backend()

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
        """Create the default process group with DeepSpeed, or join the one that exists.

        Arguments not given are read from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
        (default ``127.0.0.1``) and ``MASTER_PORT``. Calling it again is a no-op.

        On a CPU machine, the first setup for a build directory compiles DeepSpeed's
        shared-memory extension (`accord.engines.deepspeed.extension`); rank zero prints
        a notice first.

        Raises:
            MissingDependencyError: deepspeed is not installed.
            ConfigurationError: rank/world size/port settings that cannot form a group.
            CollectiveError: a killed build left the extension's lock file behind.
        """
        if self._ready:
            return self
        if kwargs:
            raise TypeError(f"Unexpected setup() arguments: {sorted(kwargs)}.")
        deepspeed = _import_deepspeed()
        import torch.distributed as dist

        if not dist.is_available():
            raise CollectiveError("This torch build has no torch.distributed support.")
        # DeepSpeed compiles its shared-memory extension silently on first use, and waits
        # forever on a lock a killed build left behind: check first, and announce a build.
        from accord.engines.deepspeed.extension import prepare_shm_extension

        own_rank = dist.get_rank() if dist.is_initialized() else _env_int("RANK", rank, default=0)
        prepare_shm_extension(announce=own_rank == 0)
        if dist.is_initialized():
            # deepspeed.comm only wraps the existing default group here; it creates none.
            deepspeed.init_distributed(
                dist_backend=str(dist.get_backend()),
                auto_mpi_discovery=False,
                verbose=False,
                timeout=self.timeout,
            )
            self._created = False
        else:
            self._init_default_group(deepspeed, rank, world_size, main_address, main_port)
            self._created = True
        comm = deepspeed.comm
        self._rank = int(comm.get_rank())
        self._world_size = int(comm.get_world_size())
        self._ready = True
        return self

    def _init_default_group(
        self,
        deepspeed: ModuleType,
        rank: int | None,
        world_size: int | None,
        main_address: str | None,
        main_port: int | None,
    ) -> None:
        rank = _env_int("RANK", rank, default=0)
        world_size = _env_int("WORLD_SIZE", world_size, default=1)
        if not 0 <= rank < world_size:
            raise ConfigurationError(
                f"rank={rank} is outside [0, world_size={world_size}). Check RANK/WORLD_SIZE."
            )
        init_method = self._init_method
        if init_method is None:
            address = main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = main_port if main_port is not None else os.environ.get("MASTER_PORT")
            if port is None:
                if world_size > 1:
                    raise ConfigurationError(
                        "DeepSpeedCollective.setup() needs a port for a multi-rank group: set "
                        "MASTER_PORT or pass main_port= (every rank must use the same one)."
                    )
                from accord.environments.local import find_free_port

                port = find_free_port()
            # The group is made on accord's shared store (one per process, a key prefix per
            # group), so a second run in the same processes never re-binds the port;
            # deepspeed.comm then wraps it.
            backend = self._backend or _default_backend()
            init_group_on_shared_store(backend, address, int(port), rank, world_size, self.timeout)
            deepspeed.init_distributed(
                dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=self.timeout
            )
            return
        deepspeed.init_distributed(
            dist_backend=self._backend or _default_backend(),
            auto_mpi_discovery=False,
            verbose=False,
            timeout=self.timeout,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
        )

    @override
    def teardown(self) -> Self:
        """Destroy the process group if `setup` created it; a no-op when called again."""
        if not self._ready:
            return self
        import torch.distributed as dist

        if self._created and dist.is_initialized():
            _ds_comm().destroy_process_group()
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

    @property
    @override
    def object_device(self) -> torch.device:
        if self.backend in ("gloo", "mpi"):
            return torch.device("cpu")
        accelerator = _import("deepspeed.accelerator").get_accelerator()
        return torch.device(accelerator.current_device_name())

    # ---------------------------------------------------------------- primitives
    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        _ds_comm().all_reduce(buffer, op=_ds_op(op))

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        _ds_comm().broadcast(_bytes_view(buffer), src=src)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        _ds_comm().all_gather_into_tensor(
            _bytes_view(output).view(-1), _bytes_view(tensor).view(-1)
        )

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        _ds_comm().reduce_scatter_tensor(output.view(-1), tensor.view(-1), op=_ds_op(op))

    @override
    def _barrier(self) -> None:
        _ds_comm().barrier()

    @override
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        _ds_comm().send(_bytes_view(tensor), dst=dst)

    @override
    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        _ds_comm().recv(_bytes_view(buffer), src=src)

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        rows = list(_bytes_view(output).unbind(0)) if output is not None else None
        _ds_comm().gather(_bytes_view(tensor), gather_list=rows, dst=dst)

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        rows = list(_bytes_view(tensor).unbind(0)) if tensor is not None else None
        _ds_comm().scatter(_bytes_view(output), scatter_list=rows, src=src)

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        _ds_comm().all_to_all_single(_bytes_view(output), _bytes_view(tensor))


def _ds_op(op: ReduceOp) -> Any:
    """The ``deepspeed.comm.ReduceOp`` for ``op`` (never MEAN: the base class divides)."""
    ds_op = _ds_comm().ReduceOp
    return {
        ReduceOp.SUM: ds_op.SUM,
        ReduceOp.MAX: ds_op.MAX,
        ReduceOp.MIN: ds_op.MIN,
        ReduceOp.PRODUCT: ds_op.PRODUCT,
    }[op]
