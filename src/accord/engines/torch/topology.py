"""The shapes a `TorchCollective` hands its strategies: sub-groups and device meshes.

A collective may run on the default group or on a sub-group of it (``group=``, or
`TorchCollective.new_subgroup`). What the torch engine's strategies run their own traffic
on follows from that: DDP's reducer on the collective's group, FSDP's shards on a
`DeviceMesh` over exactly its ranks. These functions build those groups and meshes with
torch.distributed; `TorchCollective` keeps what it built.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from math import prod
from typing import TYPE_CHECKING

import torch

from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["build_device_mesh", "check_membership", "group_members", "mesh_layout", "new_group"]


def check_membership(group: ProcessGroup, owner: str) -> None:
    """Refuse a ``group`` this process is not a member of, or whose default group is gone.

    Raises:
        ConfigurationError: naming ``owner`` (the collective given the group).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigurationError(
            f"{owner} was given a process group, but the default group it belongs to is gone: "
            "build the collective after init_process_group."
        )
    if dist.get_rank(group) < 0:
        raise ConfigurationError(
            f"Rank {dist.get_rank()} is not a member of the process group given to {owner}: "
            "build the collective only on the group's ranks."
        )


def group_members(ranks: Sequence[int]) -> list[int]:
    """``ranks`` as a sub-group's members: each once, in order."""
    return sorted(set(ranks))


def new_group(ranks: Sequence[int], world_size: int, timeout: timedelta) -> ProcessGroup:
    """A sub-group of ``ranks`` (global ranks of a world of ``world_size``); every rank of the
    world must call it, members or not.

    Raises:
        ValueError: no ranks, or a rank outside the world.
    """
    import torch.distributed as dist

    members = group_members(ranks)
    if not members or members[0] < 0 or members[-1] >= world_size:
        raise ValueError(f"Sub-group ranks must lie in [0, {world_size}), got {list(ranks)}.")
    group: ProcessGroup = dist.new_group(members, timeout=timeout)
    return group


def mesh_layout(
    shape: Sequence[int], names: Sequence[str] | None, world_size: int, owner: str
) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """``shape`` and ``names`` as tuples, checked against ``world_size`` ranks.

    Raises:
        ConfigurationError: ``shape`` does not cover the world, or the names do not match it.
    """
    sizes = tuple(int(size) for size in shape)
    named = tuple(names) if names is not None else None
    if not sizes or prod(sizes) != world_size or min(sizes) < 1:
        raise ConfigurationError(
            f"A device mesh of shape {sizes} does not cover the {world_size} ranks of this {owner}."
        )
    if named is not None and len(named) != len(sizes):
        raise ConfigurationError(f"mesh_dim_names={named} must name each of {len(sizes)} dims.")
    return sizes, named


def build_device_mesh(
    group: ProcessGroup | None,
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
    timeout: timedelta,
) -> DeviceMesh:
    """A `DeviceMesh` of ``shape`` over exactly ``group``'s ranks (None: the default group).

    The ranks fill the mesh in group order, the last dimension fastest. On the default group
    this is torch's ``init_device_mesh``; on a sub-group, a one-dimensional mesh is the
    sub-group itself and each further dimension gets groups of the sub-group's members
    only, so ranks outside it need not take part.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if len(shape) == 1:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
    me = dist.get_rank()
    groups = []
    for dim in range(len(shape)):
        # Each row along ``dim`` is one group; only its members create it.
        rows = ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
        mine = next(row for row in rows if me in row)
        groups.append(dist.new_group(mine, timeout=timeout, use_local_synchronization=True))
    return DeviceMesh.from_group(
        groups,
        device_type,
        mesh=ranks,
        mesh_dim_names=names or tuple(f"dim_{dim}" for dim in range(len(shape))),
    )
