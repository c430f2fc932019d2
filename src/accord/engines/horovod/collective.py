"""`HorovodCollective`: the collective on `horovod.torch`.

Horovod is imported only when the collective is set up or used, so ``import accord``
(and importing this module) never imports it. Horovod forms its own group: under
``horovodrun`` every process finds its rank, the world size and the rendezvous in the
``HOROVOD_*`` environment the launcher sets; a plain ``python script.py`` is a group of
one. ``setup()`` calls ``hvd.init()`` unless Horovod is initialised already (by the user
or another collective), and ``teardown()`` calls ``hvd.shutdown()`` only in the first case.

Horovod reduces ``int32``, ``int64`` and the floating types ``float16``/``float32``/
``float64``, and moves (broadcast, allgather, alltoall) those plus the 8- and 16-bit
integers. Other dtypes are handled here: narrow integers and bools are reduced as
``int64`` (and cast back, wrapping as the narrow type would), ``bfloat16`` as
``float32``, complex tensors are summed as pairs of reals, and every dtype is moved as
raw bytes. Horovod has no point-to-point, gather or scatter ops, so ``send``/``recv``,
``gather`` and ``scatter`` raise `NotImplementedError` naming the backend.

Horovod matches an op across ranks by its name, and names an unnamed op after a
per-process handle counter that every Horovod op advances, gradient reductions included.
Once the ranks have run different numbers of ops (uneven data under ``hvd.join()``),
unnamed ops would never match again, so this collective names each op itself from a
counter of its own calls, which every rank advances alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, ReduceOp
from accord.errors import CollectiveError, MissingDependencyError

__all__ = ["HorovodCollective", "horovod_available"]

# The dtypes horovod.torch's C++ ops are registered for (CPU and CUDA alike).
_REDUCIBLE = frozenset({torch.int32, torch.int64, torch.float16, torch.float32, torch.float64})
_MOVABLE = _REDUCIBLE | {torch.uint8, torch.int8, torch.int16}
_Restore = Callable[[torch.Tensor], None]


def horovod_available() -> bool:
    """Whether the ``horovod`` package is installed (it is not imported)."""
    return importlib.util.find_spec("horovod") is not None


def _missing(feature: str = "HorovodCollective") -> MissingDependencyError:
    return MissingDependencyError(feature, "horovod", "horovod")


def _hvd() -> ModuleType:
    """The ``horovod.torch`` module, or an error that says how to install it."""
    try:
        hvd = importlib.import_module("horovod.torch")
    except ImportError as err:
        raise _missing() from err
    if not hasattr(hvd, "init"):
        # horovod.torch imports without its compiled extension and only prints a warning.
        raise CollectiveError(
            "horovod is installed without its PyTorch extension (horovod.torch has no "
            "init()). Reinstall it against this torch with HOROVOD_WITH_PYTORCH=1, e.g. "
            "HOROVOD_WITH_PYTORCH=1 pip install --no-cache-dir --no-build-isolation horovod."
        )
    return hvd


class HorovodCollective(Collective):
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
        if not horovod_available():
            raise _missing()
        self._ready = False
        self._created = False
        self._rank = -1
        self._world_size = -1
        self._calls = itertools.count()

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
            MissingDependencyError: horovod is not installed.
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

    # ---------------------------------------------------------------- primitives
    def _name(self, op: str) -> str:
        """A name for the next op, the same on every rank (see the module docstring)."""
        return f"accord.{op}.{next(self._calls)}"

    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        hvd = _hvd()
        flat = buffer.view(-1)
        name = self._name("allreduce")
        if buffer.dtype in _REDUCIBLE:
            hvd.allreduce_(flat, op=_hvd_op(op), name=name)
            return
        work, restore = _reducible(flat, op)
        hvd.allreduce_(work, op=_hvd_op(op), name=name)
        restore(work)

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        _hvd().broadcast_(_movable(buffer), root_rank=src, name=self._name("broadcast"))

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        # hvd.allgather concatenates along dim 0: gather one flat row per rank, giving
        # [world_size, numel] in rank order, which is the [world_size, *shape] contract.
        rows = _hvd().allgather(
            _movable(tensor.detach()).reshape(1, -1), name=self._name("allgather")
        )
        _movable(output).view(self._world_size, -1).copy_(rows)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        hvd = _hvd()
        if op is ReduceOp.SUM and tensor.dtype in _REDUCIBLE and hasattr(hvd, "reducescatter"):
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
        rows = _movable(tensor.detach()).view(self._world_size, -1)
        received = hvd.alltoall(rows, name=self._name("alltoall"))
        if isinstance(received, tuple):  # (output, received_splits) in some releases
            received = received[0]
        _movable(output).view(self._world_size, -1).copy_(received)


def _hvd_op(op: ReduceOp) -> Any:
    """Horovod's reduction for ``op`` (never MEAN: the base class divides a Sum)."""
    hvd = _hvd()
    return {
        ReduceOp.SUM: hvd.Sum,
        ReduceOp.MAX: hvd.Max,
        ReduceOp.MIN: hvd.Min,
        ReduceOp.PRODUCT: hvd.Product,
    }[op]


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of contiguous ``tensor`` in a dtype Horovod can move (its bytes if need be)."""
    flat = tensor.view(-1)
    return flat if flat.dtype in _MOVABLE else flat.view(torch.uint8)


def _reducible(flat: torch.Tensor, op: ReduceOp) -> tuple[torch.Tensor, _Restore]:
    """A copy of ``flat`` in a dtype Horovod reduces, and a function writing a result back."""
    dtype = flat.dtype
    if dtype.is_complex and op is ReduceOp.SUM:
        # A complex sum is the sum of the real and imaginary parts.
        def restore_complex(result: torch.Tensor) -> None:
            flat.copy_(torch.view_as_complex(result))

        return torch.view_as_real(flat).clone(), restore_complex
    if dtype.is_floating_point:
        work = flat.to(torch.float32)  # bfloat16 (and float8 kinds) reduce in float32
    elif not dtype.is_complex and dtype.itemsize <= 4:
        # bool and narrow integers: reduce in int64 and cast back; the truncation wraps
        # around exactly as a reduction in the narrow type would.
        work = flat.to(torch.int64)
    else:
        raise TypeError(
            f"The horovod backend cannot reduce {dtype} tensors with {op.value!r}. Use "
            "int32, int64 or a floating dtype."
        )

    def restore(result: torch.Tensor) -> None:
        flat.copy_(result.to(dtype))

    return work, restore
