"""How `FSDPStrategy` cuts a model into FSDP2 units, and the ``fully_shard`` options for each.

A unit's parameters are gathered together before it runs and freed together after, so the
units bound the memory a forward needs: the wrap policy picks them by module class, or by
size when no classes are given.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accord.precision import PrecisionMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["fully_shard_options", "shard_units"]


def shard_units(
    module: nn.Module, policy: Collection[type[nn.Module]] | None, min_num_params: int
) -> list[nn.Module]:
    """The submodules of ``module`` to shard as units of their own, children before parents.

    With ``policy``, every submodule of one of those classes that holds parameters; without,
    every submodule whose parameters not yet in a unit reach ``min_num_params``.
    ``module`` itself is never listed: it belongs to the root unit.
    """
    units: list[nn.Module] = []
    classes = tuple(policy) if policy is not None else None

    def visit(current: nn.Module) -> int:
        # Returns how many parameters below ``current`` are not in a unit yet.
        pending = sum(visit(child) for child in current.children())
        pending += sum(p.numel() for p in current.parameters(recurse=False))
        if current is module:
            return pending
        chosen = isinstance(current, classes) if classes is not None else pending >= min_num_params
        if chosen and any(True for _ in current.parameters()):
            units.append(current)
            return 0
        return pending

    visit(module)
    return units


def fully_shard_options(
    mesh: DeviceMesh,
    precision: PrecisionMode,
    *,
    cpu_offload: bool,
    pin_memory: bool,
    reshard_after_forward: bool,
) -> dict[str, Any]:
    """Keyword arguments for ``fully_shard`` on ``mesh``.

    ``bf16-mixed`` (``16-mixed``) gathers parameters in bf16 (fp16) and reduces gradients
    in fp32; ``cpu_offload`` keeps shards, gradients and the optimizer step on the CPU;
    ``reshard_after_forward=False`` keeps gathered parameters until backward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    low = {PrecisionMode.BF16_MIXED: torch.bfloat16, PrecisionMode.FP16_MIXED: torch.float16}
    param_dtype = low.get(precision)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype is not None
        else MixedPrecisionPolicy()
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    )
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    if not reshard_after_forward:
        options["reshard_after_forward"] = False
    # Otherwise FSDP's default: reshard after forward, except the root, whose parameters
    # backward needs first anyway.
    return options
