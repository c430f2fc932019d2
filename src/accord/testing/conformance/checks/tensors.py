"""Tensor-op checks: inputs untouched, result device, ``out=``, broadcast, all_gather, shapes."""

from __future__ import annotations

import torch
from lightning_utilities.core.apply_func import apply_to_collection

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
    strided,
)
from accord.testing.conformance.expect import expect, same, same_each

__all__ = [
    "all_gather",
    "barrier",
    "broadcast",
    "inputs_unchanged",
    "out",
    "result_device",
    "shapes",
]


def inputs_unchanged(ctx: CheckContext) -> None:
    """all_reduce, broadcast, all_gather and reduce_scatter leave their input as it was."""
    c = ctx.collective
    tensors = {
        "all_reduce": rank_tensor(c.rank, torch.float32),
        "broadcast": rank_tensor(c.rank, torch.float32),
        "all_gather": rank_tensor(c.rank, torch.float32),
        "reduce_scatter": torch.arange(2 * c.world_size, dtype=torch.float32) + c.rank,
    }
    before = apply_to_collection(tensors, torch.Tensor, torch.clone)
    c.all_reduce(tensors["all_reduce"], "sum")
    c.broadcast(tensors["broadcast"], src=0)
    c.all_gather(tensors["all_gather"])
    c.reduce_scatter(tensors["reduce_scatter"], "sum")
    for name, tensor in tensors.items():
        expect(torch.equal(tensor, before[name]), f"{name} modified its input")


def result_device(ctx: CheckContext) -> None:
    """Each tensor op returns its result on the input's device."""
    c = ctx.collective
    tensor = rank_tensor(c.rank, torch.float32)
    results = {
        "all_reduce": c.all_reduce(tensor),
        "broadcast": c.broadcast(tensor),
        "all_gather": c.all_gather(tensor),
        "reduce_scatter": c.reduce_scatter(torch.ones(c.world_size)),
    }
    for name, result in results.items():
        expect(
            result.device == tensor.device,
            f"{name} returned a tensor on {result.device}, the input was on {tensor.device}",
        )


def out(ctx: CheckContext) -> None:
    """``out=`` (the input itself included) receives the result and is the tensor returned."""
    c = ctx.collective
    tensor = rank_tensor(c.rank, torch.float32)
    reduced = torch.empty_like(tensor)
    returned = c.all_reduce(tensor, "sum", out=reduced)
    in_place = tensor.clone()
    returned_in_place = c.all_reduce(in_place, "sum", out=in_place)
    gathered = torch.empty(c.world_size, *tensor.shape)
    returned_gather = c.all_gather(tensor, out=gathered)
    broadcast = torch.empty_like(tensor)
    returned_broadcast = c.broadcast(tensor, src=0, out=broadcast)
    mean = torch.empty(2)
    c.all_reduce(integer_pair(c.rank), "mean", out=mean)
    total = expected_reduce(rank_stack(c.world_size, torch.float32), ReduceOp.SUM)
    expect(returned is reduced, "all_reduce(out=) did not return out")
    same(reduced, total, "all_reduce(out=)")
    expect(returned_in_place is in_place, "all_reduce(t, out=t) did not return t")
    same(in_place, total, "all_reduce(t, out=t) (in place)")
    expect(returned_gather is gathered, "all_gather(out=) did not return out")
    same(gathered, rank_stack(c.world_size, torch.float32), "all_gather(out=)")
    expect(returned_broadcast is broadcast, "broadcast(out=) did not return out")
    same(broadcast, rank_tensor(0, torch.float32), "broadcast(out=)")
    same(mean, integer_pair_mean(c.world_size), "all_reduce(int, mean, out=)")


def broadcast(ctx: CheckContext) -> None:
    """``broadcast(t, src)`` gives every rank ``src``'s tensor, for every src and dtype."""
    c = ctx.collective
    results = {
        (src, dtype): c.broadcast(rank_tensor(c.rank, dtype), src=src)
        for src in range(c.world_size)
        for dtype in DTYPES
    }
    same_each(
        {
            f"broadcast of {dtype} from src={src}": (result, rank_tensor(src, dtype))
            for (src, dtype), result in results.items()
        }
    )


def all_gather(ctx: CheckContext) -> None:
    """``all_gather(t)`` stacks every rank's tensor in rank order, for every dtype."""
    c = ctx.collective
    results = {dtype: c.all_gather(rank_tensor(c.rank, dtype)) for dtype in DTYPES}
    same_each(
        {
            f"all_gather of {dtype} (rank order)": (result, rank_stack(c.world_size, dtype))
            for dtype, result in results.items()
        }
    )


def shapes(ctx: CheckContext) -> None:
    """0-d, empty and non-contiguous tensors work in all_reduce, broadcast and all_gather."""
    c = ctx.collective
    ws = c.world_size

    def scalar(rank: int) -> torch.Tensor:
        return torch.tensor(float(rank + 1))

    empty = torch.empty(0, 3)
    mine = strided(c.rank)
    same_each(
        {
            "0-d all_reduce": (c.all_reduce(scalar(c.rank)), per_rank(ws, scalar).sum(0)),
            "0-d broadcast": (c.broadcast(scalar(c.rank), src=0), scalar(0)),
            "0-d all_gather": (c.all_gather(scalar(c.rank)), per_rank(ws, scalar)),
            "empty all_reduce": (c.all_reduce(empty), torch.empty(0, 3)),
            "empty broadcast": (c.broadcast(empty), torch.empty(0, 3)),
            "empty all_gather": (c.all_gather(empty), torch.empty(ws, 0, 3)),
            "non-contiguous all_reduce": (c.all_reduce(mine), per_rank(ws, strided).sum(0)),
            "non-contiguous broadcast": (c.broadcast(mine, src=0), strided(0)),
            "non-contiguous all_gather": (c.all_gather(mine), per_rank(ws, strided)),
        }
    )
    expect(torch.equal(mine, strided(c.rank)), "a non-contiguous input was modified")


def barrier(ctx: CheckContext) -> None:
    """``barrier()`` and a named ``barrier(name)`` return on every rank."""
    ctx.collective.barrier()
    ctx.collective.barrier("conformance")
