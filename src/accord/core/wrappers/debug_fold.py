"""How a small call travels in `DebugCollective`'s check and is finished on every rank.

`Rows` holds the check's reused CPU buffers: this rank's fixed-size int64 row (its layout
is in `accord.core.wrappers.debug_fingerprint`) and every rank's rows once gathered, with
typed views of the payloads. `foldable` says whether a call's payload rides in the row;
`folded_result` computes, from every rank's payload, exactly what the backend would have
returned (in rank order; None where the backend's result could depend on the order).
"""

from __future__ import annotations

import array
import functools
from collections.abc import Callable
from typing import Any

import torch

from accord.core.buffers import check_out, finish
from accord.core.collective import ReduceOp
from accord.core.reduce_op import reduce_dtypes
from accord.core.wrappers.debug_fingerprint import (
    _DTYPE_IDS,
    _HEADER_WORDS,
    _ORDERED,
    _PAYLOAD_BYTES,
    _REDUCIBLE,
    _ROW_WORDS,
    parsed_op,
)
from accord.core.wrappers.wrapper import OpCall

__all__ = ["Rows", "foldable", "folded_result"]


class Rows:
    """The check's reused CPU buffers for one world size: this rank's row and every rank's
    rows, each as an array and a tensor over it, and typed views of the payloads."""

    __slots__ = ("_views", "address", "every", "gathered", "mine", "own", "world_size")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.mine = array.array("q", bytes(8 * _ROW_WORDS))
        self.address: int = self.mine.buffer_info()[0]
        self.own = torch.frombuffer(self.mine, dtype=torch.int64)
        self.every = array.array("q", bytes(8 * _ROW_WORDS * world_size))
        self.gathered = torch.frombuffer(self.every, dtype=torch.int64).view(world_size, _ROW_WORDS)
        self._views: dict[
            tuple[torch.dtype, torch.Size], tuple[torch.Tensor, tuple[torch.Tensor, ...]]
        ] = {}

    def values(
        self, dtype: torch.dtype, shape: torch.Size
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Every rank's payload as ``[world_size, *shape]`` of ``dtype``, and its rows:
        views of the gathered rows, made once per dtype and shape."""
        key = (dtype, shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            values = _values(self.gathered, dtype, shape)
            views = self._views[key] = (values, values.unbind(0))
        return views


def _values(gathered: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The payloads in gathered rows (``[world_size, _ROW_WORDS]`` int64) as
    ``[world_size, *shape]`` of ``dtype``."""
    area = gathered.view(torch.uint8)[:, _HEADER_WORDS * 8 :].view(dtype)
    return area[:, : shape.numel()].view((gathered.shape[0], *shape))


def foldable(call: OpCall, world_size: int) -> bool:
    """Whether ``call`` (valid on this rank) travels in the check's row: decided from fields
    of the fingerprint (op, reduce op, dtype, size) and the tensor's kind of device. Ranks
    that decide differently see it in the gathered rows and all run the real operation."""
    tensor = call.tensor
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.layout is not torch.strided
        or not (tensor.is_cpu or tensor.is_cuda)
        or tensor.dtype not in _DTYPE_IDS
        or tensor.numel() * tensor.element_size() > _PAYLOAD_BYTES
    ):
        return False
    if call.op != "all_reduce":
        return True  # bytes moved as they are
    if tensor.dtype not in _REDUCIBLE:
        return False
    ordered = tensor.is_floating_point() and parsed_op(call.reduce_op) in _ORDERED
    return world_size == 2 or not ordered


def _order_matters(work: torch.Tensor, values: torch.Tensor, op: ReduceOp) -> bool:
    """Whether reducing the floating-point ``values`` (one row per rank, reduced to
    ``work`` here) could give another result in another order: a NaN (which payload
    survives; a NaN anywhere makes ``work`` NaN), or for max and min a zero of both signs at
    one position (which one wins)."""
    extreme = op in (ReduceOp.MAX, ReduceOp.MIN)
    if work.numel() == 1:
        value = work.item()
        if value != value:
            return True
        if value != 0 or not extreme:
            return False
    elif bool(work.isnan().any()):
        return True
    elif not extreme or not bool((work == 0).any()):
        return False
    zeros = values == 0
    negative = zeros & torch.signbit(values)
    return bool((negative.any(0) & (zeros & ~negative).any(0)).any())


_COMBINE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MEAN: torch.add,  # divided by the world size afterwards, as the backend's path
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.PRODUCT: torch.mul,
}


def _finish(
    work: torch.Tensor,
    out: torch.Tensor | None,
    tensor: torch.Tensor,
    result_dtype: torch.dtype,
    op: ReduceOp,
    world_size: int,
) -> torch.Tensor:
    """A folded all_reduce's result from the reduced ``work``: the backend path's final
    division, cast and ``out=`` rules (`accord.core.buffers.finish`)."""
    if out is not None:
        check_out(out, tensor.shape, result_dtype, tensor.device)
    return finish(work, out, result_dtype, op, world_size)


def _into(result: torch.Tensor, out: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``result`` (gathered rows or the source's row), or ``out`` filled with it."""
    if out is None:
        return result.clone(memory_format=torch.contiguous_format)
    check_out(out, result.shape, tensor.dtype, tensor.device)
    return out.copy_(result)


def folded_result(
    call: OpCall, where: Rows | torch.Tensor, out: torch.Tensor | None
) -> Callable[[], Any] | None:
    """The folded call's result from every rank's payload, as a function to run under
    the inner wrappers; None where the backend's result could differ."""
    tensor: torch.Tensor = call.tensor
    # [world_size, *shape] and its rows: on the CPU views of the reused buffer, only read.
    if isinstance(where, Rows):
        values, rows = where.values(tensor.dtype, tensor.shape)
    else:
        values = _values(where, tensor.dtype, tensor.shape)
        rows = values.unbind(0)
    if not tensor.is_cpu:
        values = values.to(tensor.device)
        rows = values.unbind(0)
    if call.op == "all_gather":
        return functools.partial(_into, values, out, tensor)
    if call.op == "broadcast":
        return functools.partial(_into, rows[call.root], out, tensor)
    op = parsed_op(call.reduce_op)
    result_dtype, work_dtype = reduce_dtypes(tensor.dtype, op)
    if values.dtype != work_dtype:
        values = values.to(work_dtype)
        rows = values.unbind(0)
    # In rank order, into a new tensor (never the reused buffer).
    combine = _COMBINE[op]
    work = combine(rows[0], rows[1])
    for row in rows[2:]:
        combine(work, row, out=work)
    if work.is_floating_point() and _order_matters(work, values, op):
        return None
    return functools.partial(_finish, work, out, tensor, result_dtype, op, len(rows))
