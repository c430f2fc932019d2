"""A DeepSpeed ZeRO optimizer state, merged from every rank's partition into a plain one.

ZeRO-1 and ZeRO-2 keep each parameter group as one flat fp32 buffer split evenly across
the data-parallel ranks; each rank's ``*_optim_states.pt`` holds its partition of that
buffer and of every per-element optimizer tensor (Adam's ``exp_avg`` and ``exp_avg_sq``).
Concatenating the partitions in rank order and cutting the buffer by the parameter shapes
the model states file lists (``param_shapes``, in the optimizer's order) gives each
parameter's tensors back, as a plain ``optimizer.state_dict()`` numbers them. ZeRO-3 splits
every parameter on its own, a layout this module does not read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from accord.errors import CheckpointError

__all__ = ["ZERO3_OPTIMIZER_MESSAGE", "merge_zero_optimizer_states", "optimizer_files"]

ZERO3_OPTIMIZER_MESSAGE = (
    "The optimizer state of a ZeRO-3 checkpoint cannot move to another strategy yet: "
    "{path} loads with its weights only. To continue training with its optimizer state, "
    "resume with strategy='deepspeed_stage_3'; to start a new fit from its weights, "
    "write them to a file with consolidate_deepspeed_checkpoint(directory, file), load "
    "them into your module (model.load_state_dict(torch.load(file))) and fit without ckpt_path."
)
"""What a user is told when a ZeRO-3 checkpoint is read outside DeepSpeed (``{path}``)."""

_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def optimizer_files(tag_directory: Path) -> list[Path]:
    """The ``*_optim_states.pt`` files under ``tag_directory``, in data-parallel rank order.

    Raises:
        CheckpointError: there are none, a rank is missing, or the checkpoint was written
            with model (tensor) parallelism, which this reader does not merge.
    """
    found: dict[int, Path] = {}
    for file in tag_directory.iterdir():
        match = _OPTIM_FILE.search(file.name)
        if match is None:
            continue
        if int(match.group(2)) != 0:
            raise CheckpointError(
                f"{str(tag_directory)!r} was written with model parallelism ({file.name}); "
                "only data-parallel ZeRO checkpoints load under another strategy."
            )
        found[int(match.group(1))] = file
    if not found:
        raise CheckpointError(
            f"{str(tag_directory)!r} holds no ZeRO optimizer states (*_optim_states.pt)."
        )
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(
            f"{str(tag_directory)!r} lacks the optimizer states of some ranks (it has ranks "
            f"{sorted(found)}): the checkpoint is incomplete."
        )
    return [found[rank] for rank in range(len(found))]


def merge_zero_optimizer_states(
    param_shapes: Sequence[dict[str, Any]], partitions: Sequence[dict[str, Any]], source: Path
) -> dict[str, Any]:
    """One plain optimizer state dict from the base optimizer states of every rank.

    Args:
        param_shapes: per parameter group, each parameter's name and shape in the order
            ZeRO flattened them (the model states file's ``param_shapes``).
        partitions: each rank's ``base_optimizer_state``, in rank order.
        source: the checkpoint, named in errors.

    Returns:
        ``{"state": {index: {...}}, "param_groups": [...]}`` with the parameters numbered
        across the groups in order, as ``optimizer.state_dict()`` numbers them.

    Raises:
        CheckpointError: the partitions do not match the parameter shapes.
    """
    first = partitions[0]
    if len(first["param_groups"]) != len(param_shapes):
        raise CheckpointError(
            f"{str(source)!r} has {len(first['param_groups'])} optimizer parameter groups "
            f"but {len(param_shapes)} groups of parameter shapes: it is inconsistent."
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    number = 0
    for index, shapes in enumerate(param_shapes):
        group_state = [partition["state"].get(index, {}) for partition in partitions]
        flat = {
            key: torch.cat([ranks[key] for ranks in group_state])
            for key, value in group_state[0].items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
        shared = {k: v for k, v in group_state[0].items() if k not in flat}
        numbers = []
        offset = 0
        for shape in shapes.values():
            size = torch.Size(shape)
            entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in shared.items()}
            for key, buffer in flat.items():
                if offset + size.numel() > buffer.numel():
                    raise CheckpointError(
                        f"{str(source)!r}: the optimizer's {key!r} of group {index} holds "
                        f"{buffer.numel()} elements, fewer than its parameters need."
                    )
                entry[key] = buffer[offset : offset + size.numel()].view(size).clone()
            if entry:
                state[number] = entry
            numbers.append(number)
            number += 1
            offset += size.numel()
        groups.append({**first["param_groups"][index], "params": numbers})
    return {"state": state, "param_groups": groups}
