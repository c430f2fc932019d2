"""The `Collective` contract: tensor and object communication on one backend.

A backend implements a handful of in-place primitives on private, contiguous buffers
(`_all_reduce_`, `_broadcast_`, `_all_gather_into`, `_reduce_scatter_into`, `_barrier`);
this base class turns them into the public operations and keeps every promise of the
contract on every backend: inputs are never modified, results land on the input's device or
in a caller-owned ``out=`` tensor (`accord.core.buffers`), ``mean`` of an integer tensor is
a float (`accord.core.reduce_op`), objects travel as pickled bytes (`accord.core.objects`),
a bad argument gets the same error everywhere (`accord.core.op_checks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Literal, overload

import torch
from typing_extensions import Self

from accord.core.buffers import deliver, finish, output_buffer, same_memory, work_buffer
from accord.core.handle import CollectiveHandle
from accord.core.objects import all_gather_object, broadcast_object
from accord.core.op_checks import check_divisible, check_rank, check_tensor, unsupported
from accord.core.overrides import adapt_overrides
from accord.core.reduce_op import OP_SPELLINGS, ReduceOp, ReduceOpLike, reduce_dtypes
from accord.errors import CollectiveNotSetupError

__all__ = ["Collective", "CollectiveHandle", "ReduceOp", "ReduceOpLike"]


class Collective(ABC):
    """Moves tensors and Python objects between the ranks of one process group.

    Subclasses implement `setup`, `teardown`, `rank`, `world_size` and the primitives;
    the public operations below are written once, here. Optional primitives (`_send`,
    `_recv_`, `_gather_into`, `_scatter_into`, `_all_to_all_into`) raise
    `NotImplementedError` naming the backend unless overridden.

    ``all_reduce(..., async_op=True)`` works on every subclass, however its overrides are
    composed (on the class itself, a base or a mixin): an ``all_reduce`` override without
    ``async_op`` runs at the call and returns a completed `CollectiveHandle`, and an
    `_all_reduce_` override is never bypassed by an inherited `_all_reduce_async_`
    (`accord.core.overrides`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        adapt_overrides(cls, Collective._all_reduce_async_)

    backend_name: ClassVar[str] = "collective"
    """Human-readable backend name used in error messages."""
    _native_mean: bool = False
    """Whether `_all_reduce_` averages floating-point buffers itself (one op fewer)."""

    # ----------------------------------------------------------------- lifecycle
    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group (valid after `setup`)."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group (valid after `setup`)."""

    @property
    @abstractmethod
    def is_setup(self) -> bool:
        """Whether the collective is set up and usable."""

    @property
    def created_group(self) -> bool:
        """Whether `setup` created the group (and `teardown` will destroy it)."""
        return False

    @abstractmethod
    def setup(self, **kwargs: Any) -> Self:
        """Create the process group, or join one that already exists."""

    @abstractmethod
    def teardown(self) -> Self:
        """Destroy what `setup` created; a no-op when called again."""

    def abandon(self) -> None:
        """This rank's run failed: other ranks may be gone, so `teardown` must not wait for
        them. Nothing to do for a collective that never waits at teardown."""

    @property
    def object_device(self) -> torch.device:
        """Device on which pickled objects travel (CPU unless the backend needs another)."""
        return torch.device("cpu")

    @property
    def wants_engine_traffic(self) -> bool:
        """Whether traffic an engine sends itself should go through these ops instead (DDP's
        gradient buckets); True where a wrapper checks every call (`DebugCollective`)."""
        return False

    # ---------------------------------------------------------------- primitives
    @abstractmethod
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``buffer`` in place across ranks.

        ``op`` is MEAN only for a floating-point ``buffer`` on a backend that sets
        ``_native_mean``; otherwise the base class sums and divides.
        """

    def _all_reduce_async_(
        self, buffer: torch.Tensor, op: ReduceOp
    ) -> torch.futures.Future[Any] | None:
        """Start reducing ``buffer`` in place across ranks; the future completes when done.

        Same arguments as `_all_reduce_`. The future may complete with the backend's own
        error, which `_op` translates. The default runs `_all_reduce_` now and returns None
        (done already): override it where the backend has an asynchronous form.
        """
        self._all_reduce_(buffer, op)
        return None

    def _op(self, name: str) -> AbstractContextManager[None]:
        """Around waiting for a primitive ``name``: the backend's own errors as accord's."""
        return nullcontext()

    @abstractmethod
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        """Overwrite ``buffer`` on every rank with rank ``src``'s."""

    @abstractmethod
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Fill ``output[i]`` with rank ``i``'s ``tensor``; both contiguous."""

    @abstractmethod
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        """Reduce ``tensor`` across ranks and keep this rank's chunk of dim 0 in ``output``."""

    @abstractmethod
    def _barrier(self) -> None:
        """Block until every rank arrives."""

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        raise self._unsupported("send")

    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        raise self._unsupported("recv")

    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        raise self._unsupported("gather")

    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        raise self._unsupported("scatter")

    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        raise self._unsupported("all_to_all")

    # ------------------------------------------------------------ tensor ops
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: Literal[True],
    ) -> CollectiveHandle: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: bool,
    ) -> torch.Tensor | CollectiveHandle: ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | CollectiveHandle:
        """Reduce ``tensor`` across all ranks with ``op`` (sum, mean/avg, max, min, product).

        ``mean`` of an integer or bool tensor is a floating tensor; ``sum`` of a bool
        tensor counts the ranks holding True (int64); ``max``/``min``/``product`` of bools
        are any/all/all. Returns a new tensor, or ``out`` filled with the result.

        With ``async_op=True`` it returns a `CollectiveHandle` at once instead; its
        ``wait()`` returns the same result (and ``get_future()`` a future of it). The input
        is copied at the call (unless it is ``out``); ``out`` must not be used until then.
        Backends without an asynchronous form reduce at the call and return a completed
        handle.
        """
        reduce_op = OP_SPELLINGS.get(op) if isinstance(op, str) else None
        if reduce_op is None:
            reduce_op = ReduceOp.parse(op)
        if not (isinstance(tensor, torch.Tensor) and self.is_setup):
            self._check_ready("all_reduce", tensor)
        if async_op:
            return self._start_all_reduce(tensor, reduce_op, out)
        if out is None and tensor.is_floating_point():
            # The common call (a metric, a loss) in as few Python calls as possible: the
            # interpreter runs cold after every wait on the network, so each call counts.
            work = tensor.clone(memory_format=torch.contiguous_format)
            if not work.numel():
                return work
            if reduce_op is not ReduceOp.MEAN or self._native_mean:  # `_backend_op`, inlined
                self._all_reduce_(work, reduce_op)
                return work
            self._all_reduce_(work, ReduceOp.SUM)
            return work.div_(self.world_size)
        if (
            out is tensor
            and reduce_op is not ReduceOp.MEAN
            and tensor.dtype is not torch.bool
            and tensor.is_contiguous()
        ):
            # In place in the caller's buffer (a vote, a bucket): the backend reduces it as
            # it is, which is what the general path below would do in four more calls.
            if tensor.numel():
                self._all_reduce_(tensor, reduce_op)
            return tensor
        result_dtype, work_dtype = reduce_dtypes(tensor.dtype, reduce_op)
        work, target = work_buffer(tensor, tensor.shape, work_dtype, result_dtype, out)
        backend_op = self._backend_op(reduce_op, work)
        if work.numel():
            self._all_reduce_(work, backend_op)
        finish_op = ReduceOp.SUM if backend_op is ReduceOp.MEAN else reduce_op  # averaged
        return finish(work, target, result_dtype, finish_op, self.world_size)

    def _start_all_reduce(
        self, tensor: torch.Tensor, reduce_op: ReduceOp, out: torch.Tensor | None
    ) -> CollectiveHandle:
        """`all_reduce` with ``async_op=True``: the work buffer, the asynchronous primitive,
        and the finishing step (divide, cast, fill ``out``) run when it completes."""
        result_dtype, work_dtype = reduce_dtypes(tensor.dtype, reduce_op)
        work, target = work_buffer(tensor, tensor.shape, work_dtype, result_dtype, out)
        backend_op = self._backend_op(reduce_op, work)
        finish_op = ReduceOp.SUM if backend_op is ReduceOp.MEAN else reduce_op  # averaged
        finishing = (result_dtype, finish_op, self.world_size)
        started = self._all_reduce_async_(work, backend_op) if work.numel() else None
        if started is None:  # empty, or reduced at the call: nothing to wait for
            return CollectiveHandle.completed(finish(work, target, *finishing))
        # In place, averaged by the backend (a DDP gradient bucket): nothing to finish.
        finished = target is work and finish_op is not ReduceOp.MEAN and work.dtype == result_dtype
        result = (lambda: work) if finished else (lambda: finish(work, target, *finishing))
        return CollectiveHandle.after(started, result, lambda: self._op("all_reduce"))

    def _backend_op(self, op: ReduceOp, work: torch.Tensor) -> ReduceOp:
        """The op `_all_reduce_` gets for ``op`` on ``work``: MEAN only where the backend
        averages ``work`` itself (`_native_mean`, floating point), else SUM for MEAN."""
        if op is not ReduceOp.MEAN or (self._native_mean and work.is_floating_point()):
            return op
        return ReduceOp.SUM

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return rank ``src``'s ``tensor`` on every rank (same shape and dtype everywhere)."""
        self._check_ready("broadcast", tensor)
        self._check_rank("src", src)
        buffer = output_buffer(tensor, tensor.shape, out)
        if self.rank == src and not same_memory(buffer, tensor):
            buffer.copy_(tensor)
        if buffer.numel():
            self._broadcast_(buffer, src)
        return deliver(buffer, out)

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stack every rank's ``tensor`` in rank order: shape ``[world_size, *tensor.shape]``.

        Every rank must pass the same shape; the strategy's ``all_gather`` handles uneven
        first dimensions on top of this.
        """
        self._check_ready("all_gather", tensor)
        output = output_buffer(tensor, (self.world_size, *tensor.shape), out)
        if tensor.numel():
            self._all_gather_into(output, tensor.contiguous())
        return deliver(output, out)

    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reduce ``tensor`` across ranks and return this rank's chunk of its first dimension.

        ``tensor.shape[0]`` must be divisible by ``world_size``; the result has shape
        ``[tensor.shape[0] // world_size, *tensor.shape[1:]]``. Dtype rules as `all_reduce`.
        """
        reduce_op = ReduceOp.parse(op)
        self._check_ready("reduce_scatter", tensor)
        self._check_divisible("reduce_scatter", tensor)
        shape = (tensor.shape[0] // self.world_size, *tensor.shape[1:])
        result_dtype, work_dtype = reduce_dtypes(tensor.dtype, reduce_op)
        work = output_buffer(tensor, shape, out, work_dtype, result_dtype)
        source = tensor.to(work_dtype).contiguous()
        if source.numel():
            base_op = ReduceOp.SUM if reduce_op is ReduceOp.MEAN else reduce_op
            self._reduce_scatter_into(work, source, base_op)
        return finish(work, out, result_dtype, reduce_op, self.world_size)

    def barrier(self, name: str | None = None) -> None:
        """Block until every rank reaches the barrier; ``name`` labels it in diagnostics."""
        self._require_setup("barrier")
        self._barrier()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (point to point, blocking)."""
        self._check_ready("send", tensor)
        self._check_rank("dst", dst)
        self._send(tensor.contiguous(), dst)

    def recv(
        self, tensor: torch.Tensor, src: int, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Receive from rank ``src`` a tensor shaped like ``tensor`` (which is left unchanged)."""
        self._check_ready("recv", tensor)
        self._check_rank("src", src)
        buffer = output_buffer(tensor, tensor.shape, out)
        self._recv_(buffer, src)
        return deliver(buffer, out)

    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Stack every rank's ``tensor`` on rank ``dst`` (``[world_size, *shape]``); None elsewhere."""
        self._check_ready("gather", tensor)
        self._check_rank("dst", dst)
        output = None
        if self.rank == dst:
            output = output_buffer(tensor, (self.world_size, *tensor.shape), out)
        if tensor.numel():
            self._gather_into(output, tensor.contiguous(), dst)
        return None if output is None else deliver(output, out)

    def scatter(
        self, tensor: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send ``tensor[i]`` from rank ``src`` to rank ``i``.

        Every rank passes a tensor of shape ``[world_size, *shape]`` (only ``src``'s values
        are read) and gets back its ``[*shape]`` slice.
        """
        self._check_ready("scatter", tensor)
        self._check_rank("src", src)
        if tensor.dim() == 0 or tensor.shape[0] != self.world_size:
            raise ValueError(
                f"scatter needs a tensor of shape [world_size={self.world_size}, ...], "
                f"got {tuple(tensor.shape)}."
            )
        output = output_buffer(tensor, tensor.shape[1:], out)
        if tensor.numel():
            source = tensor.contiguous() if self.rank == src else None
            self._scatter_into(output, source, src)
        return deliver(output, out)

    def all_to_all(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Send chunk ``i`` of ``tensor``'s first dimension to rank ``i``.

        Returns a tensor of the same shape whose chunk ``j`` came from rank ``j``.
        """
        self._check_ready("all_to_all", tensor)
        self._check_divisible("all_to_all", tensor)
        output = output_buffer(tensor, tensor.shape, out)
        if tensor.numel():
            source = tensor.contiguous()
            if same_memory(output, source):
                source = source.clone()
            self._all_to_all_into(output, source)
        return deliver(output, out)

    # ------------------------------------------------------------ object ops
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s picklable ``obj`` on every rank (other ranks' ``obj`` is ignored).

        The other ranks unpickle what ``src`` sent, which can run code of the sender's choosing:
        use it between the ranks of one job only, never with data from outside it.

        Raises:
            TypeError: on ``src``, when ``obj`` cannot be pickled.
            CollectiveError: on the other ranks in that case, so none of them hangs.
        """
        self._require_setup("broadcast_object")
        self._check_rank("src", src)
        return broadcast_object(obj, src, self.rank, self.object_device, self._broadcast_)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable ``obj``, in rank order.

        Each rank unpickles what the others sent, which can run code of the sender's choosing:
        use it between the ranks of one job only, never with data from outside it.

        Raises:
            TypeError: on a rank whose ``obj`` cannot be pickled.
            CollectiveError: on the other ranks in that case, naming the failing ranks.
        """
        self._require_setup("all_gather_object")
        return all_gather_object(
            obj, self.rank, self.world_size, self.object_device, self._all_gather_into
        )

    # --------------------------------------------------------------- helpers
    def __repr__(self) -> str:
        state = f"rank={self.rank}, world_size={self.world_size}" if self.is_setup else "not set up"
        return f"{type(self).__name__}({state})"

    def _unsupported(self, op: str) -> NotImplementedError:
        return unsupported(op, self.backend_name, type(self).__name__)

    def _require_setup(self, op: str) -> None:
        if not self.is_setup:
            raise CollectiveNotSetupError(
                f"{type(self).__name__}.{op}() was called before setup() or after teardown(). "
                "Call collective.setup() first."
            )

    def _check_ready(self, op: str, tensor: Any) -> None:
        check_tensor(op, tensor)
        self._require_setup(op)

    def _check_divisible(self, op: str, tensor: torch.Tensor) -> None:
        check_divisible(op, tensor, self.world_size)

    def _check_rank(self, role: str, rank: int) -> None:
        check_rank(role, rank, self.world_size)
