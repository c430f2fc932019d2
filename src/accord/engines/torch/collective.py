"""`TorchCollective`: the collective on `torch.distributed` (gloo, nccl, mpi).

Besides the contract's ops it provides what the torch engine's strategies run their own
traffic on: the `process_group` (DDP's reducer) and a `device_mesh` over exactly its ranks
(FSDP's shard all-gathers and reduce-scatters), built by `accord.engines.torch.topology`.
A collective on a sub-group hands out that sub-group, so a strategy given one communicates
only within it.

A backend's own timeout inside an op (gloo: "Timed out waiting ... for recv operation")
is raised as `CollectiveTimeoutError` naming the op; ``ACCORD_COLLECTIVE_TIMEOUT`` sets that
timeout for the groups this collective creates.

``all_reduce(..., async_op=True)`` is torch's own asynchronous all-reduce: the handle's
future is the one of torch's ``Work`` (``get_future()``), with the finishing step chained.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import has_torch_function_unary
from typing_extensions import Self, override

from accord.core.buffers import byte_view
from accord.core.collective import ReduceOp
from accord.core.process_group import ProcessGroupCollective
from accord.engines.torch.backend import averages_natively, default_torch_backend, torch_op
from accord.engines.torch.topology import (
    build_device_mesh,
    check_membership,
    group_members,
    mesh_layout,
    new_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TorchCollective", "default_torch_backend"]


class TorchCollective(ProcessGroupCollective):
    """Collective on `torch.distributed`.

    ``setup()`` creates the default process group when none exists (from its arguments or
    the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` environment) or joins the
    existing one; ``teardown()`` destroys the group only if this instance created it.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default: nccl on CUDA, else gloo.
        timeout: seconds (or a timedelta) an op may wait for the other ranks.
        init_method: a torch ``init_method`` URL; default: ``MASTER_ADDR:MASTER_PORT``.
        group: a process group to run on instead of the default group, e.g. one from
            ``torch.distributed.new_group``; build the collective only on its members.
            ``setup()`` joins it and ``teardown()`` leaves it to whoever made it.
    """

    backend_name = "torch.distributed"

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: timedelta | float | None = None,
        init_method: str | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(backend, timeout=timeout, init_method=init_method)
        self._group = group
        self._meshes: dict[tuple[Any, ...], DeviceMesh] = {}
        # After setup: the group the synchronous all_reduce and all_gather call directly,
        # torch's table of groups inside a coalescing block, and their options objects.
        self._direct: ProcessGroup | None = None
        self._coalescing: dict[Any, Any] = {}
        self._reduce_options: dict[ReduceOp, Any] = {}
        self._gather_options: Any = None

    @property
    def group(self) -> ProcessGroup | None:
        """The group this collective was given or made for itself (None: the default group)."""
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

        Raises:
            ConfigurationError: settings that cannot form a group, or a ``group=`` this
                process is not a member of (or whose default group is gone).
        """
        if self._ready:
            return self
        if self._group is not None:
            check_membership(self._group, type(self).__name__)
        return super().setup(
            rank=rank,
            world_size=world_size,
            main_address=main_address,
            main_port=main_port,
            **kwargs,
        )

    @override
    def _adopt(self) -> None:
        self._native_mean = averages_natively(self.backend)
        import torch.distributed as dist
        from torch._C._distributed_c10d import AllgatherOptions

        self._meshes.clear()
        self._reduce_options.clear()
        self._direct = self.process_group
        self._coalescing = dist.distributed_c10d._world.pg_coalesce_state
        self._gather_options = AllgatherOptions()

    def __getstate__(self) -> dict[str, Any]:
        # A process group and torch's options objects do not pickle: a copy calls the
        # torch.distributed functions instead.
        state = super().__getstate__()
        state["_direct"] = None
        state["_coalescing"] = {}
        state["_reduce_options"] = {}
        state["_gather_options"] = None
        return state

    @override
    def _default_backend(self) -> str:
        return default_torch_backend()

    @override
    def teardown(self) -> Self:
        self._meshes.clear()
        self._direct = self._gather_options = None
        self._reduce_options.clear()
        return super().teardown()

    def new_subgroup(self, ranks: list[int]) -> TorchCollective | None:
        """Create a sub-group of ``ranks`` (global ranks) as a collective of its own.

        Every rank of this collective must call it. Returns the new collective on the
        members (it destroys the sub-group at teardown) and None on the other ranks.
        """
        self._require_setup("new_subgroup")
        group = new_group(ranks, self._world_size, self.timeout)
        if self._rank not in group_members(ranks):
            return None
        child = TorchCollective(self._backend, timeout=self.timeout, group=group).setup()
        child._created = True
        return child

    # ------------------------------------------------------- engine operations
    def device_mesh(
        self,
        shape: Sequence[int],
        mesh_dim_names: Sequence[str] | None = None,
        *,
        device_type: str | None = None,
    ) -> DeviceMesh:
        """A `DeviceMesh` of ``shape`` over exactly this collective's ranks.

        The ranks fill the mesh in group order, the last dimension fastest: a
        ``(replicate, shard)`` mesh of shape ``(2, 2)`` over ranks 0-3 shards within
        ``[0, 1]`` and ``[2, 3]``. On the default group this is torch's
        ``init_device_mesh``; on a sub-group, a one-dimensional mesh is the sub-group
        itself and each further dimension gets groups of the sub-group's members only, so
        ranks outside it need not take part. Every rank of the collective must call it
        with the same arguments; the mesh is kept for later calls until `teardown`, and
        its groups live as long as the default group (a sharded module still uses them).

        Args:
            shape: the mesh's size in each dimension; its product is the world size.
            mesh_dim_names: a name per dimension (FSDP's hybrid mesh: ``("replicate",
                "shard")``).
            device_type: the devices the mesh spans (default: where this collective
                moves objects, ``cpu`` for gloo).

        Raises:
            ConfigurationError: ``shape`` does not cover the world size, or the names do
                not match it.
        """
        self._require_setup("device_mesh")
        sizes, names = mesh_layout(shape, mesh_dim_names, self._world_size, type(self).__name__)
        kind = device_type or self.object_device.type
        key = (kind, sizes, names)
        if key not in self._meshes:
            self._meshes[key] = build_device_mesh(self._group, kind, sizes, names, self.timeout)
        return self._meshes[key]

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
        group = self._direct_group(buffer)
        if group is not None:
            try:  # what `with self._op(...)` does, without entering a context per call
                self._start_direct_all_reduce(group, buffer, op).wait()
            except RuntimeError as err:
                self._op("all_reduce").raise_timeout(err)
                raise
            return
        import torch.distributed as dist

        with self._op("all_reduce"):
            dist.all_reduce(self._lend(buffer), op=torch_op(op), group=self._group)

    def _direct_group(self, tensor: torch.Tensor) -> ProcessGroup | None:
        """The group to call directly for an all-reduce of ``tensor``, or None where
        torch.distributed's function must run (before setup, a tensor subclass or function
        mode, a complex tensor, inside a coalescing block). The direct call is the one that
        function makes after its checks, which accord's ops have already made: several µs
        less per call, which a latency-bound small op (a metric, a vote) feels twice over,
        and a gradient bucket's launch inside backward once per bucket."""
        group = self._direct
        if (
            group is None
            or has_torch_function_unary(tensor)
            or tensor.is_complex()
            or group in self._coalescing
        ):
            return None
        return group

    def _start_direct_all_reduce(
        self, group: ProcessGroup, buffer: torch.Tensor, op: ReduceOp
    ) -> Any:
        """Start an all-reduce of ``buffer`` on ``group`` (from `_direct_group`); its work."""
        options = self._reduce_options.get(op)
        if options is None:
            import torch.distributed as dist

            options = self._reduce_options[op] = dist.AllreduceOptions()
            options.reduceOp = torch_op(op)
        return group.allreduce([self._lend(buffer)], options)

    @override
    def _all_reduce_async_(
        self, buffer: torch.Tensor, op: ReduceOp
    ) -> torch.futures.Future[Any] | None:
        # A backend timeout shows when the work completes: the handle translates it (`_op`).
        group = self._direct_group(buffer)
        if group is not None:
            work = self._start_direct_all_reduce(group, buffer, op)
        else:
            import torch.distributed as dist

            work = dist.all_reduce(
                self._lend(buffer), op=torch_op(op), group=self._group, async_op=True
            )
        assert work is not None
        future: torch.futures.Future[Any] = work.get_future()
        return future

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        with self._op("broadcast"):
            dist.broadcast(self._lend(byte_view(buffer)), src=self._global(src), group=self._group)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        # The *_single ops (torch >= 2.13) replace the deprecated *_into_tensor names.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        output, tensor = byte_view(output).view(-1), byte_view(tensor).view(-1)
        with self._op("all_gather"):
            group = self._direct_group(output)
            direct = getattr(group, "all_gather_single", None)
            if direct is not None and not has_torch_function_unary(tensor):
                direct(self._lend(output), self._lend(tensor), self._gather_options).wait()
                return
            gather(self._lend(output), self._lend(tensor), group=self._group)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        import torch.distributed as dist

        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with self._op("reduce_scatter"):
            scatter(
                self._lend(output.view(-1)),
                self._lend(tensor.view(-1)),
                op=torch_op(op),
                group=self._group,
            )

    @override
    def _barrier(self) -> None:
        import torch.distributed as dist

        with self._op("barrier"):
            dist.barrier(group=self._group)

    @override
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        with self._op("send"):
            dist.send(self._lend(byte_view(tensor)), dst=self._global(dst), group=self._group)

    @override
    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        with self._op("recv"):
            dist.recv(self._lend(byte_view(buffer)), src=self._global(src), group=self._group)

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        rows = (
            [self._lend(row) for row in byte_view(output).unbind(0)] if output is not None else None
        )
        with self._op("gather"):
            dist.gather(
                self._lend(byte_view(tensor)), rows, dst=self._global(dst), group=self._group
            )

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        import torch.distributed as dist

        rows = (
            [self._lend(row) for row in byte_view(tensor).unbind(0)] if tensor is not None else None
        )
        with self._op("scatter"):
            dist.scatter(
                self._lend(byte_view(output)), rows, src=self._global(src), group=self._group
            )

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        with self._op("all_to_all"):
            dist.all_to_all_single(
                self._lend(byte_view(output)), self._lend(byte_view(tensor)), group=self._group
            )
