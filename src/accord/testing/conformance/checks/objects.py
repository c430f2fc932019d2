"""Object checks: ``broadcast_object`` and ``all_gather_object`` on nested Python objects."""

from __future__ import annotations

import pickle

import torch

from accord.testing.conformance.check import CheckContext
from accord.testing.conformance.data import NESTED
from accord.testing.conformance.expect import expect

__all__ = ["objects"]


def objects(ctx: CheckContext) -> None:
    """Nested objects (tensors inside) broadcast from every src and gather in rank order."""
    c = ctx.collective
    mine = {**NESTED, "rank": c.rank, "tensor": torch.tensor([c.rank])}
    srcs = range(c.world_size)
    broadcast = {src: c.broadcast_object(mine if c.rank == src else None, src=src) for src in srcs}
    gathered = c.all_gather_object(mine)
    empty = c.all_gather_object([] if c.rank % 2 else "")
    for src, obj in broadcast.items():
        expect(
            isinstance(obj, dict)
            and obj.get("rank") == src
            and obj["a"] == NESTED["a"]
            and obj["b"] == NESTED["b"]
            and torch.equal(obj["tensor"], torch.tensor([src])),
            f"broadcast_object from src={src} gave {obj!r}",
        )
    expect(len(gathered) == c.world_size, f"all_gather_object returned {len(gathered)} items")
    for rank, obj in enumerate(gathered):
        expect(
            isinstance(obj, dict) and obj.get("rank") == rank and obj["b"] == NESTED["b"],
            f"all_gather_object item {rank} is {obj!r} (rank order)",
        )
    expect(
        empty == [[] if r % 2 else "" for r in range(c.world_size)],
        f"all_gather_object of empty objects gave {empty!r}",
    )
    expect(pickle.loads(pickle.dumps(gathered[0]["a"])) == NESTED["a"], "objects round-trip")
