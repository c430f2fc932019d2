"""The one registry of conformance checks, in the order the suite runs them."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from accord.core.reduce_op import ReduceOp
from accord.testing.conformance.check import Check
from accord.testing.conformance.checks import lifecycle, objects, optional_ops, reductions, tensors

__all__ = ["CHECKS", "REGISTRY", "select"]

REGISTRY: tuple[Check, ...] = (
    Check(
        "setup.identity",
        "After setup(), rank and world_size are what the launcher set (rank 0 in a world of one).",
        lifecycle.identity,
    ),
    *(
        Check(
            f"all_reduce.{op.value}",
            f"all_reduce with op {op.value!r} on float32, float64, int64 and bool tensors.",
            functools.partial(reductions.all_reduce_op, op=op),
        )
        for op in ReduceOp
    ),
    Check(
        "all_reduce.op_names",
        "Op names are case-insensitive, avg means mean; an unknown op is a ValueError naming the "
        "valid ones.",
        reductions.op_names,
    ),
    Check(
        "all_reduce.integer_mean",
        "The mean of an integer tensor is a floating tensor, not truncated.",
        reductions.integer_mean,
    ),
    Check(
        "all_reduce.async",
        "all_reduce(..., async_op=True) returns a handle whose wait() and get_future() give the "
        "synchronous result (inputs unchanged, out= filled and returned, integer means "
        "floating), with several handles pending at once.",
        reductions.all_reduce_async,
    ),
    Check(
        "inputs_unchanged",
        "all_reduce, broadcast, all_gather and reduce_scatter leave their input unchanged.",
        tensors.inputs_unchanged,
    ),
    Check(
        "result_device",
        "Every tensor op returns its result on the input's device.",
        tensors.result_device,
    ),
    Check(
        "out",
        "out= (the input itself included) receives the result and is the tensor returned.",
        tensors.out,
    ),
    Check(
        "broadcast.src",
        "broadcast(t, src) gives every rank src's tensor, for every src and dtype.",
        tensors.broadcast,
    ),
    Check(
        "all_gather.rank_order",
        "all_gather(t) stacks every rank's tensor in rank order, for every dtype.",
        tensors.all_gather,
    ),
    Check(
        "reduce_scatter",
        "Rank r receives block r of the reduction (sum, mean, max, integer mean); a first "
        "dimension not divisible by world_size is a ValueError.",
        reductions.reduce_scatter,
    ),
    Check(
        "shapes",
        "0-d, empty and non-contiguous tensors work in all_reduce, broadcast and all_gather.",
        tensors.shapes,
    ),
    Check("barrier", "barrier() and barrier(name) return on every rank.", tensors.barrier),
    Check(
        "objects",
        "broadcast_object from every src and all_gather_object (rank order) carry nested "
        "objects, tensors and empty objects included.",
        objects.objects,
    ),
    Check(
        "send_recv",
        "send/recv around a ring of ranks, or NotImplementedError naming the backend.",
        optional_ops.send_recv,
        min_world_size=2,
    ),
    Check(
        "gather_scatter",
        "gather to one rank and scatter from one rank, or NotImplementedError naming the backend.",
        optional_ops.gather_scatter,
    ),
    Check(
        "all_to_all",
        "all_to_all exchanges chunk j of rank r with chunk r of rank j, or NotImplementedError "
        "naming the backend.",
        optional_ops.all_to_all,
    ),
    Check(
        "setup.repeat",
        "A second setup() is a no-op; teardown() is idempotent; a collective set up again after "
        "teardown() works.",
        lifecycle.repeat_setup,
    ),
    Check(
        "setup.join_existing",
        "A collective set up while a group exists joins it (created_group False), and its "
        "teardown() leaves the group up.",
        lifecycle.join_existing,
    ),
)
"""Every check, once, in the order the suite runs them."""

CHECKS: tuple[str, ...] = tuple(check.name for check in REGISTRY)
"""Every contract line, by name, in the order the suite checks them."""

_BY_NAME = {check.name: check for check in REGISTRY}


def select(names: Iterable[str] | None) -> tuple[Check, ...]:
    """The checks named ``names``, in the order given (default: the whole registry).

    Raises:
        ValueError: a name that is not in `CHECKS`.
    """
    if names is None:
        return REGISTRY
    chosen = tuple(names)
    unknown = [name for name in chosen if name not in _BY_NAME]
    if unknown:
        raise ValueError(f"Unknown conformance checks {unknown}; choose from {list(CHECKS)}.")
    return tuple(_BY_NAME[name] for name in chosen)
