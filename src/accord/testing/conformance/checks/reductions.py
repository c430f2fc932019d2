"""Reduction checks: every op on every dtype, op names, integer means, reduce_scatter, and
the asynchronous all_reduce."""

from __future__ import annotations

import torch

from accord.core.reduce_op import ReduceOp
from accord.testing.conformance.check import CheckContext
from accord.testing.conformance.data import (
    DTYPES,
    expected_reduce,
    integer_pair,
    integer_pair_mean,
    per_rank,
    rank_stack,
    rank_tensor,
    row_blocks,
)
from accord.testing.conformance.expect import expect, raises_value_error, same, same_each

__all__ = ["all_reduce_async", "all_reduce_op", "integer_mean", "op_names", "reduce_scatter"]

# Each spelling the contract accepts, with the op it means.
_SPELLINGS = {
    "SUM": ReduceOp.SUM,
    "Mean": ReduceOp.MEAN,
    "avg": ReduceOp.MEAN,
    "MAX": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}


def all_reduce_op(ctx: CheckContext, op: ReduceOp) -> None:
    """``all_reduce(t, op)`` on each of `DTYPES` gives the reduction of every rank's tensor."""
    c = ctx.collective
    results = {dtype: c.all_reduce(rank_tensor(c.rank, dtype), op.value) for dtype in DTYPES}
    same_each(
        {
            f"{op.value} of {dtype}": (result, expected_reduce(rank_stack(c.world_size, dtype), op))
            for dtype, result in results.items()
        }
    )


def op_names(ctx: CheckContext) -> None:
    """Op names are case-insensitive, ``avg`` means mean; an unknown one is a ValueError."""
    c = ctx.collective
    tensor = rank_tensor(c.rank, torch.float32)
    results = {name: c.all_reduce(tensor, name) for name in _SPELLINGS}
    stack = rank_stack(c.world_size, torch.float32)
    same_each(
        {
            f"op name {name!r}": (results[name], expected_reduce(stack, op))
            for name, op in _SPELLINGS.items()
        }
    )
    err = raises_value_error(lambda: c.all_reduce(tensor, "median"), "all_reduce(op='median')")
    expect(
        "sum" in str(err) and "mean" in str(err),
        f"the ValueError for an unknown op does not name the valid ones: {err}",
    )


def integer_mean(ctx: CheckContext) -> None:
    """The mean of an integer tensor is floating point and not truncated."""
    c = ctx.collective
    result = c.all_reduce(integer_pair(c.rank), "mean")
    expect(result.is_floating_point(), f"mean of int64 returned {result.dtype}")
    same(result, integer_pair_mean(c.world_size, result.dtype), "mean of int64")


def reduce_scatter(ctx: CheckContext) -> None:
    """Rank r receives block r of the reduction; an indivisible first dimension is a ValueError."""
    c = ctx.collective
    ws = c.world_size
    ops = (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX)
    results = {op: c.reduce_scatter(row_blocks(c.rank, ws), op.value) for op in ops}
    int_result = c.reduce_scatter(torch.arange(ws, dtype=torch.int64) + c.rank, "mean")
    stack = per_rank(ws, lambda rank: row_blocks(rank, ws))
    mine = slice(2 * c.rank, 2 * c.rank + 2)
    same_each(
        {
            f"reduce_scatter {op.value}": (result, expected_reduce(stack, op)[mine])
            for op, result in results.items()
        }
    )
    expected_int = torch.tensor([c.rank + (ws - 1) / 2], dtype=torch.get_default_dtype())
    same(int_result, expected_int, "reduce_scatter mean of int64")
    if ws > 1:
        raises_value_error(
            lambda: c.reduce_scatter(torch.ones(ws + 1), "sum"),
            "reduce_scatter of a first dimension not divisible by world_size",
        )


def all_reduce_async(ctx: CheckContext) -> None:
    """``all_reduce(..., async_op=True)`` returns a handle whose ``wait()`` and future give the
    synchronous form's result, with its promises: inputs unchanged, ``out=`` filled and
    returned, the input's device, integer means floating; several handles may be pending."""
    c = ctx.collective
    inputs = {
        (op, dtype): rank_tensor(c.rank, dtype)
        for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX)
        for dtype in DTYPES
    }
    before = {key: tensor.clone() for key, tensor in inputs.items()}
    # Every handle is started before any is waited on: pending operations overlap.
    handles = {
        key: c.all_reduce(tensor, key[0].value, async_op=True) for key, tensor in inputs.items()
    }
    out = torch.empty(2, 3)
    out_handle = c.all_reduce(rank_tensor(c.rank, torch.float32), "sum", out=out, async_op=True)
    in_place = rank_tensor(c.rank, torch.float32)
    in_place_handle = c.all_reduce(in_place, "mean", out=in_place, async_op=True)
    integer_handle = c.all_reduce(integer_pair(c.rank), "mean", async_op=True)
    empty_handle = c.all_reduce(torch.empty(0, 3), "sum", async_op=True)
    future_handle = c.all_reduce(rank_tensor(c.rank, torch.float64), "sum", async_op=True)
    from_future = future_handle.get_future().wait()
    results = {key: handle.wait() for key, handle in handles.items()}
    returned_out = out_handle.wait()
    returned_in_place = in_place_handle.wait()
    integer = integer_handle.wait()
    empty = empty_handle.wait()
    waited = future_handle.wait()
    pending = [*handles.values(), out_handle, in_place_handle, integer_handle, future_handle]
    expect(
        all(handle.is_completed() for handle in pending),
        "a handle is not completed after wait() returned",
    )
    for (op, dtype), result in results.items():
        same(
            result,
            expected_reduce(rank_stack(c.world_size, dtype), op),
            f"async {op.value} of {dtype}",
        )
        expect(
            result.device == inputs[op, dtype].device,
            f"async all_reduce returned a tensor on {result.device}, the input was on "
            f"{inputs[op, dtype].device}",
        )
        expect(
            torch.equal(inputs[op, dtype], before[op, dtype]),
            f"async all_reduce {op.value} of {dtype} modified its input",
        )
    stack = rank_stack(c.world_size, torch.float32)
    expect(returned_out is out, "async all_reduce(out=): wait() did not return out")
    same(out, expected_reduce(stack, ReduceOp.SUM), "async all_reduce(out=)")
    expect(returned_in_place is in_place, "async all_reduce(t, out=t): wait() did not return t")
    same(in_place, expected_reduce(stack, ReduceOp.MEAN), "async all_reduce(t, out=t) (in place)")
    expect(integer.is_floating_point(), f"async mean of int64 returned {integer.dtype}")
    same(integer, integer_pair_mean(c.world_size, integer.dtype), "async mean of int64")
    same(empty, torch.empty(0, 3), "async all_reduce of an empty tensor")
    expect(from_future is waited, "the handle's future and wait() gave different tensors")
    same(
        waited,
        expected_reduce(rank_stack(c.world_size, torch.float64), ReduceOp.SUM),
        "async future",
    )
