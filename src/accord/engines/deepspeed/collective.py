"""`DeepSpeedCollective`: the collective on `deepspeed.comm`.

DeepSpeed is imported only when the collective is set up or used, so ``import accord``
(and importing this module) never imports it. ``deepspeed.comm`` wraps the default
torch.distributed group, so this collective either creates that group (on accord's shared
rendezvous store, or through ``deepspeed.init_distributed`` for an ``init_method``) and
lets DeepSpeed wrap it, or lets DeepSpeed wrap one that already exists (made by torchrun,
a user's ``init_process_group`` or another collective). ``all_reduce(..., async_op=True)``
runs ``deepspeed.comm.all_reduce(..., async_op=True)`` and waits on its work's future.
"""

from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import Any, ClassVar

import torch
from typing_extensions import override

from accord.core.buffers import byte_view
from accord.core.collective import ReduceOp
from accord.core.process_group import ProcessGroupCollective
from accord.core.rendezvous_address import Rendezvous
from accord.imports import import_optional, require

__all__ = ["DeepSpeedCollective"]

_FEATURE = "DeepSpeedCollective"


class DeepSpeedCollective(ProcessGroupCollective):
    """Collective on `deepspeed.comm`.

    ``setup()`` creates the default process group when none exists (from its arguments or
    the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` environment) and has
    DeepSpeed wrap it, or has DeepSpeed wrap the existing one; ``teardown()`` destroys the
    group only if this instance created it. Every primitive, ``send``/``recv``,
    ``gather``/``scatter`` and ``all_to_all`` included, runs through ``deepspeed.comm``.

    On a CPU machine, the first setup for a build directory compiles DeepSpeed's
    shared-memory extension (`accord.engines.deepspeed.extension`); rank zero prints a
    notice first, and a lock a killed build left behind is a `CollectiveError`.

    Args:
        backend: the torch.distributed backend DeepSpeed uses (``"gloo"``, ``"nccl"``,
            ``"mpi"``, ``"ccl"``, ``"hccl"``); default: gloo on CPU, else the
            accelerator's own (nccl on CUDA).
        timeout: seconds (or a timedelta) an op may wait for the other ranks.
        init_method: a torch ``init_method`` URL; default: ``MASTER_ADDR:MASTER_PORT``.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        ConfigurationError: an unknown backend.
    """

    backend_name = "deepspeed.comm"
    backends: ClassVar[tuple[str, ...]] = ("gloo", "nccl", "mpi", "ccl", "hccl")
    backend_kind: ClassVar[str] = "DeepSpeed communication"

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: timedelta | float | None = None,
        init_method: str | None = None,
    ) -> None:
        require("deepspeed", _FEATURE)
        super().__init__(backend, timeout=timeout, init_method=init_method)
        self._comm: Any = None

    # ------------------------------------------------------------ engine hooks
    @override
    def _default_backend(self) -> str:
        """gloo on CPU; on an accelerator, the communication backend DeepSpeed picks for it."""
        accelerator = import_optional("deepspeed.accelerator", _FEATURE).get_accelerator()
        if accelerator.device_name() == "cpu":
            return "gloo"
        return str(accelerator.communication_backend_name())

    @override
    def _prepare(self, rank: int) -> None:
        self._comm = import_optional("deepspeed.comm", _FEATURE)
        # DeepSpeed compiles its shared-memory extension silently on first use, and waits
        # forever on a lock a killed build left behind: check first, and announce a build.
        from accord.engines.deepspeed.extension import prepare_shm_extension

        prepare_shm_extension(announce=rank == 0)

    @override
    def _join(self) -> None:
        import torch.distributed as dist

        # deepspeed.comm only wraps the existing default group here; it creates none.
        import_optional("deepspeed", _FEATURE).init_distributed(
            dist_backend=str(dist.get_backend()),
            auto_mpi_discovery=False,
            verbose=False,
            timeout=self.timeout,
        )

    @override
    def _init_with_method(self, backend: str, meeting: Rendezvous) -> None:
        import_optional("deepspeed", _FEATURE).init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            timeout=self.timeout,
            init_method=meeting.init_method,
            rank=meeting.rank,
            world_size=meeting.world_size,
        )

    @override
    def _destroy(self) -> None:
        self._comm.destroy_process_group()

    @property
    @override
    def object_device(self) -> torch.device:
        if self.backend in ("gloo", "mpi"):
            return torch.device("cpu")
        accelerator = import_optional("deepspeed.accelerator", _FEATURE).get_accelerator()
        return torch.device(accelerator.current_device_name())

    # ---------------------------------------------------------------- primitives
    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        with self._op("all_reduce"):
            self._comm.all_reduce(self._lend(buffer), op=_ds_op(self._comm, op))

    @override
    def _all_reduce_async_(
        self, buffer: torch.Tensor, op: ReduceOp
    ) -> torch.futures.Future[Any] | None:
        # A backend timeout shows when the work completes: the handle translates it (`_op`).
        work = self._comm.all_reduce(self._lend(buffer), op=_ds_op(self._comm, op), async_op=True)
        future: torch.futures.Future[Any] = work.get_future()
        return future

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        with self._op("broadcast"):
            self._comm.broadcast(self._lend(byte_view(buffer)), src=src)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        with self._op("all_gather"):
            self._comm.all_gather_into_tensor(
                self._lend(byte_view(output).view(-1)), self._lend(byte_view(tensor).view(-1))
            )

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        with self._op("reduce_scatter"):
            self._comm.reduce_scatter_tensor(
                self._lend(output.view(-1)), self._lend(tensor.view(-1)), op=_ds_op(self._comm, op)
            )

    @override
    def _barrier(self) -> None:
        with self._op("barrier"):
            self._comm.barrier()

    @override
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        with self._op("send"):
            self._comm.send(self._lend(byte_view(tensor)), dst=dst)

    @override
    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        with self._op("recv"):
            self._comm.recv(self._lend(byte_view(buffer)), src=src)

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        rows = (
            [self._lend(row) for row in byte_view(output).unbind(0)] if output is not None else None
        )
        with self._op("gather"):
            self._comm.gather(self._lend(byte_view(tensor)), gather_list=rows, dst=dst)

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        rows = (
            [self._lend(row) for row in byte_view(tensor).unbind(0)] if tensor is not None else None
        )
        with self._op("scatter"):
            self._comm.scatter(self._lend(byte_view(output)), scatter_list=rows, src=src)

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        with self._op("all_to_all"):
            self._comm.all_to_all_single(
                self._lend(byte_view(output)), self._lend(byte_view(tensor))
            )


def _ds_op(comm: ModuleType, op: ReduceOp) -> Any:
    """The ``deepspeed.comm.ReduceOp`` for ``op`` (never MEAN: the base class divides)."""
    return {
        ReduceOp.SUM: comm.ReduceOp.SUM,
        ReduceOp.MAX: comm.ReduceOp.MAX,
        ReduceOp.MIN: comm.ReduceOp.MIN,
        ReduceOp.PRODUCT: comm.ReduceOp.PRODUCT,
    }[op]
