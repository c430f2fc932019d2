"""`HorovodCollective`: the collective on `horovod.torch`.

Horovod is imported only when the collective is set up or used, so ``import accord``
(and importing this module) never imports it. Horovod forms its own group: under
``horovodrun`` every process finds its rank, the world size and the rendezvous in the
``HOROVOD_*`` environment the launcher sets; a plain ``python script.py`` is a group of
one. ``setup()`` calls ``hvd.init()`` unless Horovod is initialised already (by the user
or another collective), and ``teardown()`` calls ``hvd.shutdown()`` only in the first case.

Dtypes Horovod's ops lack are converted (`accord.engines.horovod.dtypes`). Horovod has no
point-to-point, gather or scatter ops, so ``send``/``recv``, ``gather`` and ``scatter``
raise `NotImplementedError` naming the backend. ``all_reduce(..., async_op=True)`` reduces at
the call and returns a completed handle: Horovod's own asynchronous handles complete only
when polled or synchronised, which a `torch.futures.Future` cannot wait on.

Besides the contract's ops, the collective carries what `HorovodStrategy` sends: the
broadcast of a module's weights and of an optimizer's state, the wrapping of an
optimizer in ``hvd.DistributedOptimizer`` (whose backward hooks reduce the gradients),
the wait for those reductions, and ``hvd.join()`` for uneven data.

Horovod matches an op across ranks by its name, and names an unnamed op after a
per-process handle counter that every Horovod op advances, gradient reductions included.
Once the ranks have run different numbers of ops (uneven data under ``hvd.join()``),
unnamed ops would never match again, so this collective names each op itself from a
counter of its own calls, which every rank advances alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Self, override

from accord.core.collective import ReduceOp
from accord.core.membership import MemberCollective
from accord.engines.horovod.dtypes import (
    MOVABLE_DTYPES,
    REDUCIBLE_DTYPES,
    BFloat16AsFloat32,
    movable,
    reducible,
)
from accord.errors import CollectiveError
from accord.imports import import_optional, require

__all__ = ["HorovodCollective"]


def _hvd() -> Any:
    """The ``horovod.torch`` module, or an error that says how to rebuild it."""
    hvd = import_optional("horovod.torch", "HorovodCollective")
    if not hasattr(hvd, "init"):
        # horovod.torch imports without its compiled extension and only prints a warning.
        raise CollectiveError(
            "horovod is installed without its PyTorch extension (horovod.torch has no "
            "init()). Reinstall it against this torch with HOROVOD_WITH_PYTORCH=1, e.g. "
            "HOROVOD_WITH_PYTORCH=1 pip install --no-cache-dir --no-build-isolation horovod."
        )
    return hvd


class HorovodCollective(MemberCollective):
    """Collective on `horovod.torch` (``hvd.allreduce``, ``hvd.broadcast``, ...).

    Ranks come from ``hvd.rank()``/``hvd.size()``; `local_rank`, `local_size` and
    `cross_rank` (the node's rank) are Horovod's too. ``all_reduce``'s ``mean`` is a
    Horovod ``Sum`` divided by the world size, as on every backend; ``reduce_scatter``
    uses ``hvd.reducescatter`` for sums and reduces then keeps this rank's chunk for the
    other ops (Horovod's reducescatter only sums); ``barrier`` is ``hvd.barrier()``.

    Raises:
        MissingDependencyError: horovod is not installed.
    """

    backend_name = "horovod"

    def __init__(self) -> None:
        require("horovod", "HorovodCollective")
        super().__init__()
        self._calls = itertools.count()

    # ----------------------------------------------------------------- lifecycle

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``hvd.local_rank()``)."""
        self._require_setup("local_rank")
        return int(_hvd().local_rank())

    @property
    def local_size(self) -> int:
        """Processes on this node (``hvd.local_size()``)."""
        self._require_setup("local_size")
        return int(_hvd().local_size())

    @property
    def cross_rank(self) -> int:
        """The rank of this process's node (``hvd.cross_rank()``)."""
        self._require_setup("cross_rank")
        return int(_hvd().cross_rank())

    @override
    def setup(self, **kwargs: Any) -> Self:
        """Initialise Horovod (``hvd.init()``), or join the Horovod that is running.

        Horovod reads its ranks from the launcher's environment, so there is nothing to
        pass. Calling it again is a no-op.

        Raises:
            CollectiveError: horovod was built without its PyTorch extension.
            TypeError: arguments were passed.
        """
        if self._ready:
            return self
        if kwargs:
            raise TypeError(
                f"Unexpected setup() arguments: {sorted(kwargs)}. Horovod takes its ranks "
                "from horovodrun's environment."
            )
        hvd = _hvd()
        if hvd.is_initialized():
            self._created = False
        else:
            hvd.init()
            self._created = True
        self._rank = int(hvd.rank())
        self._world_size = int(hvd.size())
        self._calls = itertools.count()
        self._ready = True
        return self

    @override
    def teardown(self) -> Self:
        """Shut Horovod down if `setup` initialised it; a no-op when called again."""
        if not self._ready:
            return self
        if self._created:
            hvd = _hvd()
            if hvd.is_initialized():
                hvd.shutdown()
        self._ready = False
        self._created = False
        self._rank = self._world_size = -1
        return self

    def join(self, device: torch.device | None = None) -> int:
        """Say this rank has no more data, and wait until every rank has said so.

        Until then this rank takes part in the other ranks' allreduces (of gradients)
        with zeros. Returns the rank that joined last. ``device``: where Horovod makes
        those zero tensors (a CUDA device, or CPU by default).
        """
        self._require_setup("join")
        hvd = _hvd()
        index = device.index if device is not None and device.type == "cuda" else None
        last = int(hvd.join(-1 if index is None else index))
        # The ranks that had data ran ops this rank answered with zeros without counting
        # them (the Trainer's per-step decision, say): all continue from the highest count,
        # so the next op has the same name everywhere.
        count = torch.tensor([next(self._calls)], dtype=torch.int64)
        top = hvd.allreduce(count, op=hvd.Max, name="accord.join.counter")
        self._calls = itertools.count(int(top.item()) + 1)
        return last

    # ------------------------------------------------------ what a strategy sends
    @property
    def horovod_initialized(self) -> bool:
        """Whether Horovod runs in this process (this collective's `setup` or the user's)."""
        return bool(_hvd().is_initialized())

    def broadcast_module(self, module: nn.Module, src: int = 0) -> None:
        """Overwrite every parameter and buffer of ``module`` with rank ``src``'s, in place.

        Tensors Horovod moves as they are go in one ``hvd.broadcast_parameters``; the
        others (bool, bfloat16, non-contiguous) through `broadcast`.
        """
        self._require_setup("broadcast_module")
        if self._world_size == 1:
            return
        native: dict[str, torch.Tensor] = {}
        for name, tensor in module.state_dict(keep_vars=False).items():
            if not tensor.numel():
                continue
            if tensor.dtype in MOVABLE_DTYPES and tensor.is_contiguous():
                native[name] = tensor
            else:
                self.broadcast(tensor, src, out=tensor)
        if native:
            _hvd().broadcast_parameters(native, root_rank=src)

    def broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, src: int = 0) -> None:
        """Give ``optimizer`` on every rank rank ``src``'s state and hyper-parameters.

        When ``src``'s optimizer has no state yet (a fresh one) only the hyper-parameters
        travel: ``hvd.broadcast_optimizer_state`` would create the state with a
        zero-gradient step, which counts a step (Adam) and moves the weights (weight
        decay). A rank without state whose ``src`` has some still takes that step, so
        broadcast the module after the optimizers.
        """
        self._require_setup("broadcast_optimizer_state")
        if self._world_size == 1:
            return
        if self.broadcast_object(bool(optimizer.state), src):
            _hvd().broadcast_optimizer_state(optimizer, root_rank=src)
            return
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        settings = self.broadcast_object(settings, src)
        for group, values in zip(optimizer.param_groups, settings, strict=True):
            group.update(values)

    def distributed_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Sequence[tuple[str, torch.Tensor]],
        **options: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer`` wrapped in ``hvd.DistributedOptimizer``.

        Its backward hooks reduce the gradients of ``named_parameters`` while backward
        runs, as Horovod's own allreduces, named after the parameters (the names must be
        unique and the same on every rank). The wrapper is a new optimizer sharing
        ``optimizer``'s parameter groups. ``options`` are ``DistributedOptimizer``'s own
        (``backward_passes_per_step``, ``compression``, ``gradient_predivide_factor``,
        ...); ``op`` defaults to an average, and with bfloat16 parameters and no
        ``compression`` the gradients travel as float32 (`BFloat16AsFloat32`).
        """
        self._require_setup("distributed_optimizer")
        hvd = _hvd()
        options.setdefault("op", hvd.Average)
        if options.get("compression") is None:
            options.pop("compression", None)
            if any(p.dtype == torch.bfloat16 for _, p in named_parameters):
                options["compression"] = BFloat16AsFloat32
        wrapped: torch.optim.Optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=list(named_parameters), **options
        )
        return wrapped

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for the gradient reductions of a `distributed_optimizer`.

        Gradients whose hooks did not fire (a short last accumulation window) are
        reduced now; every rank must call it for the same optimizer.
        """
        self._require_setup("synchronize")
        optimizer.synchronize()  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- primitives
    def _name(self, op: str) -> str:
        """A name for the next op, the same on every rank (see the module docstring)."""
        return f"accord.{op}.{next(self._calls)}"

    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        hvd = _hvd()
        flat = buffer.view(-1)
        name = self._name("allreduce")
        if buffer.dtype in REDUCIBLE_DTYPES:
            hvd.allreduce_(flat, op=_hvd_op(op), name=name)
            return
        work, restore = reducible(flat, op)
        hvd.allreduce_(work, op=_hvd_op(op), name=name)
        restore(work)

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        _hvd().broadcast_(movable(buffer), root_rank=src, name=self._name("broadcast"))

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        # hvd.allgather concatenates along dim 0: gather one flat row per rank, giving
        # [world_size, numel] in rank order, which is the [world_size, *shape] contract.
        rows = _hvd().allgather(
            movable(tensor.detach()).reshape(1, -1), name=self._name("allgather")
        )
        movable(output).view(self._world_size, -1).copy_(rows)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        hvd = _hvd()
        if (
            op is ReduceOp.SUM
            and tensor.dtype in REDUCIBLE_DTYPES
            and hasattr(hvd, "reducescatter")
        ):
            # Horovod splits dim 0 evenly in rank order; it is divisible by world_size here.
            name = self._name("reducescatter")
            output.copy_(hvd.reducescatter(tensor.detach(), name=name, op=hvd.Sum).view_as(output))
            return
        reduced = tensor.detach().clone()
        self._all_reduce_(reduced, op)
        output.view(-1).copy_(reduced.view(self._world_size, -1)[self._rank])

    @override
    def _barrier(self) -> None:
        hvd = _hvd()
        if hasattr(hvd, "barrier"):
            hvd.barrier()
        else:  # horovod < 0.23: a one-element allreduce waits for every rank as well
            hvd.allreduce_(torch.zeros(1), op=hvd.Sum, name=self._name("barrier"))

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        hvd = _hvd()
        if not hasattr(hvd, "alltoall"):
            raise self._unsupported("all_to_all")
        # Without splits Horovod sends equal chunks of dim 0: one row per rank here.
        rows = movable(tensor.detach()).view(self._world_size, -1)
        received = hvd.alltoall(rows, name=self._name("alltoall"))
        if isinstance(received, tuple):  # (output, received_splits) in some releases
            received = received[0]
        movable(output).view(self._world_size, -1).copy_(received)


def _hvd_op(op: ReduceOp) -> Any:
    """Horovod's reduction for ``op`` (never MEAN: the base class divides a Sum)."""
    hvd = _hvd()
    return {
        ReduceOp.SUM: hvd.Sum,
        ReduceOp.MAX: hvd.Max,
        ReduceOp.MIN: hvd.Min,
        ReduceOp.PRODUCT: hvd.Product,
    }[op]
