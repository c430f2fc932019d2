"""The inputs the checks send and the results they expect, computed from rank and world size.

Every input depends on the rank that sends it (and on the element), so a result taken from
the wrong rank, in the wrong order, or reduced with the wrong op shows as a wrong value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accord.core.reduce_op import ReduceOp

__all__ = [
    "DTYPES",
    "NESTED",
    "expected_reduce",
    "integer_pair",
    "integer_pair_mean",
    "per_rank",
    "rank_stack",
    "rank_tensor",
    "row_blocks",
    "strided",
]

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.int64, torch.bool)
"""The dtypes the reductions, broadcasts and gathers are checked on."""

NESTED: dict[str, Any] = {"a": [1, 2.5, ("x", None)], "b": {"c": {1, 2}}, "t": "text"}
"""A nested Python object for the object collectives."""


def rank_tensor(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A 2x3 tensor of ``dtype`` whose values depend on ``rank`` and on the element."""
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return (base + 1 + rank * 10).to(dtype)


def per_rank(world_size: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``make(rank)`` for every rank, stacked in rank order (what an all_gather returns)."""
    return torch.stack([make(rank) for rank in range(world_size)])


def rank_stack(world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's `rank_tensor`, stacked in rank order."""
    return per_rank(world_size, lambda rank: rank_tensor(rank, dtype))


def row_blocks(rank: int, world_size: int) -> torch.Tensor:
    """A float64 ``(2 * world_size, 3)`` tensor: two rows per rank for a reduce_scatter."""
    return torch.arange(2 * world_size * 3, dtype=torch.float64).reshape(2 * world_size, 3) + rank


def strided(rank: int) -> torch.Tensor:
    """A non-contiguous 4x3 tensor (a transposed 3x4) whose values depend on ``rank``."""
    return (torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank).t()


def integer_pair(rank: int) -> torch.Tensor:
    """The int64 tensor ``[rank, 1]``, whose mean over ranks is not an integer."""
    return torch.tensor([rank, 1], dtype=torch.int64)


def integer_pair_mean(world_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mean of every rank's `integer_pair` (default dtype: torch's default float)."""
    return torch.tensor([(world_size - 1) / 2, 1.0], dtype=dtype or torch.get_default_dtype())


def expected_reduce(stack: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """What reducing the rank-ordered ``stack`` over its first dimension with ``op`` gives.

    The mean of an integer or bool tensor is floating point; the max and min of bools are
    their any and all.
    """
    if stack.dtype == torch.bool:
        if op is ReduceOp.SUM:
            return stack.to(torch.int64).sum(0)
        if op is ReduceOp.MEAN:
            return stack.to(torch.get_default_dtype()).mean(0)
        if op is ReduceOp.MAX:
            return stack.any(0)
        return stack.all(0)
    if op is ReduceOp.MEAN:
        work = stack if stack.is_floating_point() else stack.to(torch.get_default_dtype())
        return work.sum(0) / stack.shape[0]
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.MAX:
        return stack.max(0).values
    if op is ReduceOp.MIN:
        return stack.min(0).values
    return stack.prod(0)
