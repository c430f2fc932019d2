"""Checks of the ops a backend may lack: each works, or raises NotImplementedError naming it."""

from __future__ import annotations

import torch

from accord.testing.conformance.check import CheckContext
from accord.testing.conformance.data import rank_stack, rank_tensor
from accord.testing.conformance.expect import Unsupported, expect, optional_op, same

__all__ = ["all_to_all", "gather_scatter", "send_recv"]


def send_recv(ctx: CheckContext) -> None:
    """Around a ring, each rank receives what its left neighbour sent it."""
    c = ctx.collective
    right, left = (c.rank + 1) % c.world_size, (c.rank - 1) % c.world_size

    def exchange() -> torch.Tensor:
        # Even ranks send first and odd ranks receive first, so no rank deadlocks.
        payload = torch.full((3,), float(c.rank))
        if c.rank % 2 == 0:
            c.send(payload, dst=right)
            return c.recv(torch.empty(3), src=left)
        got = c.recv(torch.empty(3), src=left)
        c.send(payload, dst=right)
        return got

    got = optional_op(c, "send/recv", exchange)
    if not isinstance(got, Unsupported):
        same(got, torch.full((3,), float(left)), f"recv from {left}")


def gather_scatter(ctx: CheckContext) -> None:
    """``gather`` stacks every rank's tensor on dst only; ``scatter`` hands out src's rows."""
    c = ctx.collective
    root = c.world_size - 1
    source = rank_stack(c.world_size, torch.float32) * (1 if c.rank == root else -1)
    gathered = optional_op(
        c, "gather", lambda: c.gather(rank_tensor(c.rank, torch.float32), dst=root)
    )
    scattered = optional_op(c, "scatter", lambda: c.scatter(source, src=root))
    if not isinstance(gathered, Unsupported):
        if c.rank == root:
            expect(gathered is not None, "gather returned None on dst")
            assert gathered is not None
            same(gathered, rank_stack(c.world_size, torch.float32), f"gather to dst={root}")
        else:
            expect(gathered is None, "gather returned a tensor on a rank that is not dst")
    if not isinstance(scattered, Unsupported):
        same(scattered, rank_tensor(c.rank, torch.float32), f"scatter from src={root}")


def all_to_all(ctx: CheckContext) -> None:
    """Rank r's chunk j arrives as chunk r on rank j."""
    c = ctx.collective
    # Chunk j of rank r holds 100 * r + j, so rank r must receive 100 * j + r from rank j.
    source = torch.tensor([100.0 * c.rank + j for j in range(c.world_size)])
    received = optional_op(c, "all_to_all", lambda: c.all_to_all(source))
    if not isinstance(received, Unsupported):
        expected = torch.tensor([100.0 * j + c.rank for j in range(c.world_size)])
        same(received, expected, "all_to_all")
