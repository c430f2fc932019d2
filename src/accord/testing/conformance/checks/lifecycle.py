"""Lifecycle checks: identity after ``setup()``, repeated setup, joining an existing group."""

from __future__ import annotations

import torch

from accord.testing.conformance.check import CheckContext
from accord.testing.conformance.expect import expect, same

__all__ = ["identity", "join_existing", "repeat_setup"]


def _world_sum(world_size: int) -> torch.Tensor:
    return torch.full((1,), float(world_size))


def identity(ctx: CheckContext) -> None:
    """After ``setup()``, ``rank`` and ``world_size`` are the launcher's (rank 0 of one)."""
    c = ctx.collective
    expect(c.is_setup, "is_setup is False after setup()")
    if c.world_size == 1:
        expect(c.rank == 0, f"rank is {c.rank} in a world of size 1")
        return
    expect(
        (c.rank, c.world_size) == (ctx.rank, ctx.world_size),
        f"rank/world_size are {(c.rank, c.world_size)}, the launcher set "
        f"{(ctx.rank, ctx.world_size)} (RANK/WORLD_SIZE)",
    )


def repeat_setup(ctx: CheckContext) -> None:
    """A second ``setup()`` is a no-op; ``teardown()`` is idempotent; a second one joins."""
    c = ctx.collective
    c.setup()
    after_second_setup = c.all_reduce(torch.ones(1))
    fresh = ctx.factory().setup()
    created = fresh.created_group
    fresh.teardown()
    fresh.teardown()
    still_setup = fresh.is_setup
    again = fresh.setup()
    result = again.all_reduce(torch.ones(1))
    again.teardown()
    same(after_second_setup, _world_sum(c.world_size), "all_reduce after a second setup()")
    expect(not still_setup, "is_setup is True after teardown()")
    same(result, _world_sum(c.world_size), "all_reduce after teardown() + setup()")
    expect(not created, "a second collective created a group while one existed (it must join)")


def join_existing(ctx: CheckContext) -> None:
    """A collective set up while a group exists joins it, and its teardown leaves it up."""
    c = ctx.collective
    joiner = ctx.factory().setup()
    joined = joiner.all_reduce(torch.ones(1))
    joiner_created = joiner.created_group
    joiner.teardown()
    after = c.all_reduce(torch.ones(1))
    expect(
        c.created_group or c.world_size == 1,
        "the first collective did not record that it created the group",
    )
    expect(not joiner_created, "a collective joining an existing group recorded that it created it")
    same(joined, _world_sum(c.world_size), "all_reduce on a joined group")
    same(
        after,
        _world_sum(c.world_size),
        "all_reduce after the joiner's teardown() (it must not destroy the group)",
    )
