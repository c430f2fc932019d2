"""`XLACollective`: the collective on torch_xla (TPUs, and XLA's CPU runtime).

torch_xla is imported only when the collective is set up or used, so ``import accord``
never imports it. The group is the XLA runtime's replication, which torch_xla's launcher
(``xmp.spawn``, see `XLALauncher`) sets up before any rank runs; ``rank`` is
``torch_xla.runtime.global_ordinal()`` and ``world_size`` is
``torch_xla.runtime.world_size()``.

Two facts about XLA shape every primitive here:

- XLA is lazy: a collective is a node in a graph that runs when the graph is launched.
  Each op first launches its input (so pending, possibly rank-specific work never becomes
  part of the collective's program), builds the collective on device data only, launches
  that small program and waits for it. So an op's result is ready when it returns, and
  ``all_reduce(..., async_op=True)`` returns a completed handle.
- Several ranks may share one process, one thread per device: torch_xla does this on the
  CPU runtime (``CPU_NUM_DEVICES=N``) and on TPU hosts with several cores per chip. There
  the ranks' collectives meet only when every rank runs the *same compiled executable*:
  two separately compiled copies of one graph get different collective ids and wait for
  each other forever. Two rules guarantee it. Programs are launched under one
  process-wide lock (`launch`), so the first rank compiles and the others hit
  torch_xla's compilation cache. And no program embeds a rank-dependent constant: what
  differs per rank travels as device data (XLA turns a 0-d tensor holding 0 or 1 into a
  constant, so single values travel as one-element tensors). That is why
  ``xm.all_gather`` runs with ``pin_layout=False`` (the pinned variant pads by ordinal),
  why broadcast is a masked ``xm.all_reduce`` on the tensor's bits rather than
  ``xm.collective_broadcast`` (which multiplies, so NaN or -0.0 would not survive), and
  why ``xm.rendezvous`` (built on the pinned all_gather) is the barrier only where each
  process holds one rank. And such ranks meet in Python before each program that holds a
  collective (`XLACollective` waits for the others of its process): XLA ends the whole
  process when one of them reaches a collective 15 s after another, which a rank on a
  busy machine, or one compiling a program its peer already has, does without anything
  being wrong.

Besides the contract's ops, the collective carries what the XLA strategies send of their
own: the averaging of an optimizer's gradients with XLA's bucketed all-reduce
(`XLACollective.reduce_gradients`) and the fused average-and-step
(`XLACollective.optimizer_step`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import Self, override

from accord.core.collective import ReduceOp
from accord.core.membership import MemberCollective
from accord.core.timeouts import DEFAULT_TIMEOUT, timeout_from_env
from accord.engines.xla.programs import gate, launch
from accord.errors import CollectiveTimeoutError
from accord.imports import require

__all__ = ["XLACollective", "launch", "parameters_with_gradients"]

_REDUCE_TYPES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "mul",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
}
"""accord's reductions as torch_xla names them (``xm.REDUCE_SUM``, ...)."""

_NARROW = frozenset({torch.bfloat16, torch.float16})
"""Floating dtypes XLA's CPU runtime cannot all-reduce: gradients in them travel as float32."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size: data movement adds zeros to these, bit-exactly."""

# XLA's runtime is per process, and so are these: the lock around the dtype views of
# `_bits`, and which collective joined first on each rank, so setup() can report whether it
# created the rank's membership, as torch.distributed reports a default group.
_VIEW_LOCK = threading.Lock()
_MEMBERS_LOCK = threading.Lock()
_MEMBERS: dict[int, int] = {}


class XLACollective(MemberCollective):
    """Collective on torch_xla: ``xm.all_reduce``, ``xm.all_gather``, ``xm.reduce_scatter``,
    ``xm.all_to_all`` and ``xm.rendezvous``.

    Tensors may live on the XLA device or on the CPU; a CPU tensor is copied to this
    rank's XLA device for the op and the result copied back, so results are always on the
    input's device. ``send``/``recv``, ``gather`` and ``scatter`` are not available:
    torch_xla has no gather or scatter collective, and its channel-based send/recv is not
    exposed here.

    ``setup()`` joins the XLA runtime's replication (torch_xla's launcher creates it; a
    process that was not launched is a world of one). The first collective set up on a
    rank records that it created the rank's membership (`created_group`); later ones join
    it. ``teardown()`` waits for the rank's pending device work and leaves; it is
    idempotent.

    Raises:
        MissingDependencyError: torch_xla is not installed.
    """

    backend_name = "torch_xla"

    def __init__(self) -> None:
        require("torch_xla", "XLACollective")
        super().__init__()
        self._device: torch.device | None = None
        self._shares_process = False
        self._gate: threading.Barrier | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def device(self) -> torch.device:
        """This rank's XLA device (valid after `setup`)."""
        self._require_setup("device")
        assert self._device is not None
        return self._device

    @override
    def setup(self, **kwargs: Any) -> Self:
        """Join the XLA runtime's replication; a no-op when called again.

        Ranks come from the runtime, so no arguments are accepted.
        """
        if self._ready:
            return self
        if kwargs:
            raise TypeError(
                f"XLACollective.setup() takes no arguments (ranks come from the XLA runtime), "
                f"got {sorted(kwargs)}."
            )
        import torch_xla
        import torch_xla.runtime as xr

        self._device = torch.device(torch_xla.device())
        self._rank = int(xr.global_ordinal())
        self._world_size = int(xr.world_size())
        local_ranks = int(xr.addressable_device_count())
        self._shares_process = local_ranks > 1
        self._gate = gate(local_ranks) if self._shares_process else None
        with _MEMBERS_LOCK:
            self._created = self._rank not in _MEMBERS
            if self._created:
                _MEMBERS[self._rank] = id(self)
        self._ready = True
        return self

    @override
    def teardown(self) -> Self:
        if not self._ready:
            return self
        launch()
        if self._created:
            with _MEMBERS_LOCK:
                if _MEMBERS.get(self._rank) == id(self):
                    del _MEMBERS[self._rank]
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        self._device = None
        self._gate = None
        return self

    # ---------------------------------------------------------------- primitives
    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        if self._world_size == 1:
            return
        import torch_xla.core.xla_model as xm

        self._run(buffer, lambda x: xm.all_reduce(_REDUCE_TYPES[op], x))

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        if self._world_size == 1:
            return
        import torch_xla.core.xla_model as xm

        # Every rank runs one program: keep the bits where the (device-data) mask says this
        # is src, zeros elsewhere, and sum. Integers add zeros exactly, NaN and -0.0 too.
        keep = torch.tensor([self._rank == src]).to(self.device)

        def masked_sum(bits: torch.Tensor) -> torch.Tensor:
            summed: torch.Tensor = xm.all_reduce("sum", torch.where(keep, bits, bits.new_zeros(())))
            return summed

        self._run(_bits(buffer), masked_sum)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        if self._world_size == 1:
            output[0].copy_(tensor)
            return
        import torch_xla.core.xla_model as xm

        self._run(
            _bits(tensor),
            lambda x: xm.all_gather(x.unsqueeze(0), dim=0, pin_layout=False),
            into=_bits(output),
        )

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        if self._world_size == 1:
            output.copy_(tensor)
            return
        import torch_xla.core.xla_model as xm

        ws = self._world_size
        self._run(
            tensor,
            lambda x: xm.reduce_scatter(_REDUCE_TYPES[op], x, 1.0, 0, ws),
            into=output,
        )

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        if self._world_size == 1:
            output.copy_(tensor)
            return
        import torch_xla.core.xla_model as xm

        ws = self._world_size
        self._run(_bits(tensor), lambda x: xm.all_to_all(x, 0, 0, ws), into=_bits(output))

    @override
    def barrier(self, name: str | None = None) -> None:
        self._require_setup("barrier")
        self._barrier_named(name or "accord.barrier")

    @override
    def _barrier(self) -> None:
        self._barrier_named("accord.barrier")

    def _barrier_named(self, tag: str) -> None:
        if self._shares_process:
            # xm.rendezvous would compile a different program per rank here (see the
            # module docstring); an all_reduce that every rank must join is a barrier too.
            token = torch.ones(1, dtype=torch.int32)
            self._all_reduce_(token, ReduceOp.SUM)
            return
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients across the ranks with XLA's bucketed all-reduce.

        The pending backward pass is launched first, on its own, and the reduction after
        it, so the averaged gradients are ready when this returns. bfloat16 and float16
        gradients are averaged as float32 (XLA's CPU runtime has no all-reduce for them)
        and given back in their own dtype.
        """
        self._require_setup("reduce_gradients")
        pairs = parameters_with_gradients(optimizer)
        if pairs:
            launch([grad for _, grad in pairs])  # the backward pass, on its own
        if self._world_size == 1 or not pairs:
            return
        import torch_xla.core.xla_model as xm

        if any(grad.dtype in _NARROW for _, grad in pairs):
            wide = [grad.to(torch.float32) for _, grad in pairs]
            xm.all_reduce(xm.REDUCE_SUM, wide, scale=1.0 / self._world_size)
            for (param, grad), averaged in zip(pairs, wide, strict=True):
                param.grad = averaged.to(grad.dtype)
        else:
            xm.reduce_gradients(optimizer)
        self._meet("reduce_gradients")
        launch([grad for _, grad in parameters_with_gradients(optimizer)])

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients across the ranks, then step it.

        The backward pass is launched first; then ``xm.optimizer_step`` builds the
        reduction and the step into one program, launched here. With bfloat16 or float16
        gradients it is `reduce_gradients`, then ``optimizer.step()`` (which the caller
        launches).
        """
        self._require_setup("optimizer_step")
        pairs = parameters_with_gradients(optimizer)
        if any(grad.dtype in _NARROW for _, grad in pairs) and self._world_size > 1:
            self.reduce_gradients(optimizer)
            optimizer.step()
            return
        import torch_xla.core.xla_model as xm

        if pairs:
            launch([grad for _, grad in pairs])  # the backward pass, on its own
        xm.optimizer_step(optimizer)
        if self._world_size > 1:
            self._meet("optimizer_step")
            launch()

    # ------------------------------------------------------------------ helpers
    def _meet(self, op: str) -> None:
        """Wait until every rank of this process is about to launch its collective."""
        if self._gate is None:
            return
        timeout = timeout_from_env() or DEFAULT_TIMEOUT
        try:
            self._gate.wait(timeout.total_seconds())
        except threading.BrokenBarrierError:
            raise CollectiveTimeoutError(
                f"Rank {self._rank} waited more than {timeout.total_seconds():.0f} s in {op} "
                "for the other ranks of its process (or one of them gave up waiting). A rank "
                "that never comes usually means the ranks called different collectives.",
                op=op,
                rank=self._rank,
            ) from None

    def _run(
        self,
        tensor: torch.Tensor,
        build: Callable[[torch.Tensor], torch.Tensor],
        *,
        into: torch.Tensor | None = None,
    ) -> None:
        """Run ``build(device_data_of(tensor))`` as one program; write the result ``into``.

        ``into`` defaults to ``tensor`` itself (the in-place primitives).
        """
        target = tensor if into is None else into
        # XLA bakes a 0-d tensor holding 0 or 1 into the program as a constant, which
        # would give ranks different programs; one element travels as data.
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if flat.device.type == "xla":
            launch([flat])  # pending work stays out of the collective's program
            source = flat
        else:
            source = flat.to(self.device)
        result = build(source)
        self._meet("collective")
        launch([result])
        target.copy_(result if result.shape == target.shape else result.reshape(target.shape))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size (bytes where there is none)."""
    dtype = _BITS.get(tensor.element_size())
    # One rank at a time: the ranks' process crashed (SIGSEGV, both ranks in this view of
    # an XLA tensor) as two ranks broadcast their parameters at the start of a fit.
    with _VIEW_LOCK:
        if dtype is not None:
            return tensor if tensor.dtype == dtype else tensor.view(dtype)
        return tensor.reshape(-1).view(torch.uint8)


def parameters_with_gradients(
    optimizer: torch.optim.Optimizer,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) for each of ``optimizer``'s parameters that has a gradient."""
    return [
        (param, param.grad)
        for group in optimizer.param_groups
        for param in group["params"]
        if param.grad is not None
    ]
