"""The buffer of `DebugCollective`'s check, and how a one-element call rides in it.

Every rank sends the same thing whatever it calls: a ``sum`` all-reduce of two float64
numbers, ``[payload, 2 * digest + folded]``. ``digest`` is a hash of the call's fingerprint,
small enough (`digest_bits`) that the sum of every rank's second number is exact; ``folded``
is 1 where this rank put its payload in the first number. Two small numbers because the
backends move them fastest: on gloo a two-element all-reduce costs a little more than a
one-element one costs, an all-gather or a longer all-reduce clearly more.

Rank ``r`` reads the sum ``s`` of the second numbers as ``s - 2 * world_size * digest_r``
(`spread`): with every digest equal it is the number of ranks that folded, between 0 and
the world size. Any other digest moves it out of that range on every rank whose digest is
not the exact mean of all of them: with two different calls, every rank; with three or
more, every rank but one whose digest happens to be their mean.

`fold_limit` and `payload` say what a call puts in the first number. A one-element ``sum`` or ``mean``
all-reduce whose result cannot depend on the order of the operands (a float32 or float64
in a world of two, an integer or bool small enough to add exactly in float64) and a
one-element broadcast (the source sends its value, every other rank ``-0.0``, which adds
nothing, not even a sign) fold: the sum is then the call's result, and `folded_result`
finishes it the backend's way (mean's division, the result dtype, ``out=``). A sum that is
NaN, overflows the integer dtype or the float32 range goes to the backend after all, as
every rank sees the same sum. Everything else sends ``0.0`` and the real operation follows.
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
from accord.core.wrappers.debug_fingerprint import DTYPE_IDS
from accord.core.wrappers.wrapper import OpCall

__all__ = ["CheckBuffer", "digest_bits", "fold_limit", "folded_result", "payload", "spread"]

# Integers up to this size add exactly in float64 (2**53), with room for the world's sum.
_EXACT = 2**53
# One-element all-reduces that fold: floating-point only where one addition has no order.
_ORDERLESS_FLOATS = frozenset({torch.float32, torch.float64})
_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool})
# One-element broadcasts that fold: float64 holds every value of these exactly (every
# dtype a fingerprint names but the complex ones).
_BROADCAST = frozenset(DTYPE_IDS) - {torch.complex64, torch.complex128}
_FLOAT32_MAX = torch.finfo(torch.float32).max


class CheckBuffer:
    """The check's reused CPU buffer for one world size: two float64 numbers, as an array and
    a tensor over it, and the shift that keeps `digest_bits` of a 64-bit digest."""

    __slots__ = ("numbers", "shift", "tensor")

    def __init__(self, world_size: int) -> None:
        self.shift = 64 - digest_bits(world_size)
        self.numbers = array.array("d", (0.0, 0.0))
        self.tensor = torch.frombuffer(self.numbers, dtype=torch.float64)


def digest_bits(world_size: int) -> int:
    """How many bits of the digest the check buffer carries: the sum of ``world_size`` numbers
    ``2 * digest + 1`` stays below 2**53, where float64 counts exactly."""
    return 52 - world_size.bit_length()


def spread(check_sum: float, digest: int, world_size: int) -> int:
    """How many ranks folded, if every rank sent ``digest``; out of ``[0, world_size]``
    where some rank sent another one."""
    return int(check_sum) - 2 * world_size * digest


def fold_limit(call: OpCall, reduce: ReduceOp | None, world_size: int) -> int | None:
    """Whether ``call`` (valid on this rank, with its parsed ``reduce`` op) can fold: None
    where it cannot, else the bound an integer payload's magnitude must stay under (0: any
    value). Depends only on the kind of call (op, arguments, the tensor's dtype, size,
    layout and device), never on the values."""
    tensor = call.tensor
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.numel() != 1
        or tensor.layout is not torch.strided
        or not (tensor.is_cpu or tensor.is_cuda)
    ):
        return None
    dtype = tensor.dtype
    if call.op == "broadcast":
        if dtype not in _BROADCAST:
            return None
        return 0 if dtype.is_floating_point else _EXACT
    if call.op != "all_reduce" or (reduce is not ReduceOp.SUM and reduce is not ReduceOp.MEAN):
        return None
    if dtype in _ORDERLESS_FLOATS:
        return 0 if world_size == 2 else None
    return _EXACT // world_size if dtype in _INTEGERS else None


def payload(call: OpCall, limit: int, rank: int) -> float | None:
    """What ``call``, which can fold under ``limit`` (`fold_limit`), puts in the check
    buffer's first number, or None where its value does not fold. Ranks that decide
    differently see it in the sum and all run the real operation."""
    if call.op == "broadcast" and rank != call.root:
        return -0.0
    value = call.tensor.item()
    if limit and abs(value) >= limit:
        return None
    return float(value)


def _filled(
    value: bool | int | float, out: torch.Tensor | None, tensor: torch.Tensor
) -> torch.Tensor:
    """A folded broadcast's result: ``value`` in a new tensor like ``tensor``, or in ``out``."""
    if out is None:
        return torch.full(tensor.shape, value, dtype=tensor.dtype, device=tensor.device)
    check_out(out, tensor.shape, tensor.dtype, tensor.device)
    return out.fill_(value)


def _reduced(
    value: int | float,
    out: torch.Tensor | None,
    tensor: torch.Tensor,
    op: ReduceOp,
    dtypes: tuple[torch.dtype, torch.dtype],
    world_size: int,
) -> torch.Tensor:
    """A folded all_reduce's result: the backend path's final division, cast and ``out=``
    rules (`accord.core.buffers.finish`) applied to the summed ``value``."""
    result_dtype, work_dtype = dtypes
    if out is not None:
        check_out(out, tensor.shape, result_dtype, tensor.device)
    work = torch.full(tensor.shape, value, dtype=work_dtype, device=tensor.device)
    return finish(work, out, result_dtype, op, world_size)


def folded_result(
    call: OpCall,
    reduce: ReduceOp | None,
    total: float,
    out: torch.Tensor | None,
    world_size: int,
) -> Callable[[], Any] | None:
    """The folded call's result from the check buffer's summed first number, as a function to run
    under the inner wrappers; None where the backend's result could differ (every rank
    decides the same, from the same sum)."""
    if total != total:
        return None  # NaN: which NaN the backend returns is its own
    tensor: torch.Tensor = call.tensor
    dtype = tensor.dtype
    if call.op == "broadcast":
        value: bool | int | float = total
        if dtype == torch.bool:
            value = bool(total)
        elif not dtype.is_floating_point:
            value = int(total)
        return functools.partial(_filled, value, out, tensor)
    assert reduce is not None  # a folded all_reduce's op parsed
    dtypes = reduce_dtypes(dtype, reduce)
    work_dtype = dtypes[1]
    if work_dtype.is_floating_point:
        if work_dtype == torch.float32 and abs(total) > _FLOAT32_MAX:
            return None  # the backend's float32 sum overflows to an infinity
        return functools.partial(_reduced, total, out, tensor, reduce, dtypes, world_size)
    info = torch.iinfo(work_dtype)
    if not info.min <= total <= info.max:
        return None  # the backend's integer sum wraps around
    return functools.partial(_reduced, int(total), out, tensor, reduce, dtypes, world_size)
