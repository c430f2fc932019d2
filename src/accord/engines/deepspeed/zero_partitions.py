"""A DeepSpeed ZeRO optimizer state, merged from every rank's partition into a plain one.

ZeRO-1 and ZeRO-2 keep each parameter group as one flat fp32 buffer split evenly across
the data-parallel ranks; each rank's ``*_optim_states.pt`` holds its partition of that
buffer and of every per-element optimizer tensor (Adam's ``exp_avg`` and ``exp_avg_sq``).
Concatenating the partitions in rank order and cutting the buffer by the parameter shapes
the model states file lists (``param_shapes``, in the optimizer's order) gives each
parameter's tensors back, as a plain ``optimizer.state_dict()`` numbers them.

ZeRO-3 splits every parameter on its own: each parameter is padded to a multiple of the
rank count and each rank holds an equal slice of it, so a rank's flat buffer is its slice
of every parameter of the group, one after the other. Taking each parameter's slice from
every rank in rank order and dropping the padding gives it back whole.

`split_for_rank` goes the other way, for a ZeRO-1/2 engine that resumes from a plain
optimizer state: the group's parameters flattened in order, padded, and this rank's slice.
`put_optimizer_state` puts such a state into the engine's partitions with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from accord.errors import CheckpointError

__all__ = [
    "merge_zero3_optimizer_states",
    "merge_zero_optimizer_states",
    "numbered_state",
    "optimizer_files",
    "put_optimizer_state",
    "split_for_rank",
]

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
    return _merge_partitions(param_shapes, partitions, source, striped=False)


def merge_zero3_optimizer_states(
    param_shapes: Sequence[dict[str, Any]], partitions: Sequence[dict[str, Any]], source: Path
) -> dict[str, Any]:
    """One plain optimizer state dict from the ZeRO-3 base optimizer states of every rank.

    Args:
        param_shapes: per parameter group, each parameter's name and shape in the order
            ZeRO-3 partitioned them (the model states file's ``param_shapes``).
        partitions: each rank's ``base_optimizer_state``, in rank order.
        source: the checkpoint, named in errors.

    Returns:
        As `merge_zero_optimizer_states` returns.

    Raises:
        CheckpointError: the partitions do not match the parameter shapes.
    """
    return _merge_partitions(param_shapes, partitions, source, striped=True)


def _merge_partitions(
    param_shapes: Sequence[dict[str, Any]],
    partitions: Sequence[dict[str, Any]],
    source: Path,
    *,
    striped: bool,
) -> dict[str, Any]:
    """The merge of `merge_zero_optimizer_states` (``striped=False``: the ranks' flat
    buffers, one after another, hold each group's parameters in order) and of
    `merge_zero3_optimizer_states` (``striped=True``: every parameter is split into
    equal, padded slices, one in each rank's buffer)."""
    first = partitions[0]
    if len(first["param_groups"]) != len(param_shapes):
        raise CheckpointError(
            _groups_mismatch(source, len(first["param_groups"]), len(param_shapes), striped)
        )
    ranks = len(partitions)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    number = 0
    for index, shapes in enumerate(param_shapes):
        group_state = [partition["state"].get(index, {}) for partition in partitions]
        flat = {
            key: [rank[key] for rank in group_state]
            for key, value in group_state[0].items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
        if not striped:
            flat = {key: [torch.cat(buffers)] for key, buffers in flat.items()}
        shared = {k: v for k, v in group_state[0].items() if k not in flat}
        numbers = []
        offset = 0
        for shape in shapes.values():
            size = torch.Size(shape)
            # Each rank's slice (its padding included), or the whole parameter.
            part = -(-size.numel() // ranks) if striped else size.numel()
            entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in shared.items()}
            for key, buffers in flat.items():
                if any(offset + part > buffer.numel() for buffer in buffers):
                    raise CheckpointError(_short_buffer(source, key, index, buffers, striped))
                whole = torch.cat([buffer[offset : offset + part] for buffer in buffers])
                entry[key] = whole[: size.numel()].view(size).clone()
            if entry:
                state[number] = entry
            numbers.append(number)
            number += 1
            offset += part
        groups.append({**first["param_groups"][index], "params": numbers})
    return {"state": state, "param_groups": groups}


def _groups_mismatch(source: Path, groups: int, shape_groups: int, striped: bool) -> str:
    if striped:
        return (
            f"{str(source)!r} has {groups} ZeRO-3 optimizer groups but {shape_groups} groups "
            "of parameter shapes (sub-groups split by sub_group_size are not read); resume "
            "from it with strategy='deepspeed_stage_3'."
        )
    return (
        f"{str(source)!r} has {groups} optimizer parameter groups but {shape_groups} groups "
        "of parameter shapes: it is inconsistent."
    )


def _short_buffer(
    source: Path, key: str, index: int, buffers: list[torch.Tensor], striped: bool
) -> str:
    if striped:
        return (
            f"{str(source)!r}: the ZeRO-3 optimizer's {key!r} of group {index} "
            "holds fewer elements than its parameters need."
        )
    return (
        f"{str(source)!r}: the optimizer's {key!r} of group {index} holds "
        f"{buffers[0].numel()} elements, fewer than its parameters need."
    )


def split_for_rank(tensors: Sequence[torch.Tensor], partition_size: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-1/2 partition of the flat buffer of ``tensors`` (one group's
    parameters, or their optimizer tensors, in the group's order): flattened, padded with
    zeros to ``partition_size`` times the rank count, and sliced."""
    flat = torch.cat([tensor.detach().reshape(-1).float() for tensor in tensors])
    start = partition_size * rank
    end = start + partition_size
    if flat.numel() < end:
        flat = torch.cat([flat, flat.new_zeros(end - flat.numel())])
    return flat[start:end].clone()


def put_optimizer_state(engine: Any, state: dict[str, Any], rank: int, source: Path) -> None:
    optimizer = engine.optimizer
    if int(engine.zero_optimization_stage()) >= 3:
        raise CheckpointError(
            f"{str(source)!r} is not a ZeRO-3 checkpoint of this world size, and a ZeRO-3 run "
            "resumes only from one. Resume from it under deepspeed_stage_2, ddp, fsdp or one "
            "device, or load its weights (model.load_state_dict) before fit()."
        )
    groups = optimizer.bit16_groups
    ordered = getattr(optimizer, "round_robin_bit16_groups", groups)
    partitions = optimizer.single_partition_of_fp32_groups
    base = optimizer.optimizer
    numbered = numbered_state(state)
    saved_groups = numbered.get("param_groups", [])
    sizes = [len(group) for group in groups]
    if [len(group.get("params", [])) for group in saved_groups] != sizes:
        raise CheckpointError(
            f"{str(source)!r} holds an optimizer state whose groups do not fit this run's "
            f"(groups of {[len(g.get('params', [])) for g in saved_groups]} parameters; this "
            f"run has {sizes}). Resume with the configure_optimizers() that saved it."
        )
    number_of = {id(p): k for k, p in enumerate(p for group in groups for p in group)}
    saved = numbered.get("state", {})
    for index, group in enumerate(ordered):
        entries = [saved.get(number_of[id(p)]) for p in group]
        present = [entry for entry in entries if entry is not None]
        if not present:
            continue
        if len(present) != len(entries):
            raise CheckpointError(
                f"{str(source)!r}: some parameters of optimizer group {index} have state and "
                "others have none; the checkpoint is incomplete."
            )
        partition = partitions[index]
        first = present[0]
        flat = {
            key: split_for_rank([entry[key] for entry in present], partition.numel(), rank).to(
                partition.device, partition.dtype
            )
            for key, value in first.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
        shared = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in first.items()
            if k not in flat
        }
        base.state[partition] = {**shared, **flat}
        base.param_groups[index].update(
            {k: v for k, v in saved_groups[index].items() if k != "params"}
        )


def numbered_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (FSDP's), numbered in its groups' order."""
    groups = state.get("param_groups", [])
    names = [name for group in groups for name in group.get("params", [])]
    if not all(isinstance(name, str) for name in names):
        return state
    number = {name: index for index, name in enumerate(names)}
    return {
        "state": {number[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in groups],
    }
