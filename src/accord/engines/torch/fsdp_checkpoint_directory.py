"""FSDP's sharded checkpoint directory: written, read into shards, read whole, converted.

FSDP writes a checkpoint in one of two kinds; loading accepts either:

* ``"sharded"``: a directory written with `torch.distributed.checkpoint` (every rank
  writes its shards) plus `META_FILE` with everything that is not a model or optimizer
  tensor. It loads into any number of ranks. This module writes and reads it.
* ``"full"``: one ordinary checkpoint file written by rank 0, its tensors gathered to CPU
  (`accord.checkpoint.save_checkpoint_file`); the model part loads into a plain module as
  well.

A sharded checkpoint is written under a temporary name beside its destination and renamed
into place (`accord.checkpoint.writing`), so a crash leaves the previous one intact.
`read_sharded_whole` reads one into whole tensors in a single process; it is registered
with `accord.checkpoint`, so a strategy that does not shard (DDP, one device) resumes from
a sharded checkpoint too. The state-dict options FSDP's strategy methods read and load with
(`accord.engines.torch.fsdp_strategy_checkpoints`) are here as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from accord.checkpoint.compiled_names import plain_name
from accord.checkpoint.reading import load_checkpoint_file, register_directory_reader
from accord.checkpoint.writing import (
    move_into_place,
    remove_checkpoint_path,
    save_checkpoint_file,
    staging_path,
)
from accord.core.strategy import Strategy
from accord.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "write_sharded_offline",
    "META_FILE",
    "holds_dtensors",
    "load_options",
    "load_sharded",
    "name_parameters",
    "read_sharded_whole",
    "save_sharded",
    "state_dict_options",
]

META_FILE = "accord_meta.pt"
"""The file inside a sharded checkpoint directory that holds the non-tensor state."""


def state_dict_options(*, full: bool) -> StateDictOptions:
    """How to read a model's or optimizer's state: its own shards, or the full tensors
    gathered to rank 0's CPU (the other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def load_options(state: dict[str, Any], strict: bool = True) -> StateDictOptions:
    """How to load ``state``: every rank holds what it loads, its own shards (DTensors) or
    a copy of the full tensors.

    A state without any tensor (plain SGD's optimizer state) loads as this rank's own:
    torch's full-state path needs a tensor to find the device to place them on.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    full = _holds(state, torch.Tensor) and not holds_dtensors(state)
    return StateDictOptions(full_state_dict=full, strict=strict)


def holds_dtensors(state: Any) -> bool:
    """Whether a (nested) state dict holds DTensors: one read from a sharded checkpoint."""
    from torch.distributed.tensor import DTensor

    return _holds(state, DTensor)


def _holds(state: Any, kind: type) -> bool:
    found: list[bool] = []
    apply_to_collection(state, kind, lambda _: found.append(True))
    return bool(found)


def save_sharded(
    strategy: Strategy, checkpoint: dict[str, Any], path: Path, process_group: ProcessGroup
) -> None:
    """Write ``checkpoint`` as a sharded directory at ``path`` (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    from accord.engines.torch.safe_dcp import checkpoint_errors

    staging = staging_path(path)
    tensors: dict[str, Any] = {"model": checkpoint["state_dict"]}
    optimizer_states = checkpoint.get("optimizer_states", [])
    for index, state in enumerate(optimizer_states):
        tensors[f"optimizer_{index}"] = state
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["sharded"] = True
    meta["fsdp_sharded"] = {
        "optimizer_count": len(optimizer_states),
        "world_size": strategy.world_size,
    }
    if strategy.is_global_zero:
        remove_checkpoint_path(staging)  # left over from a run that crashed mid-save
    strategy.barrier("fsdp_save_checkpoint_start")
    with checkpoint_errors("write", staging):
        save(tensors, checkpoint_id=staging, process_group=process_group)
    if strategy.is_global_zero:
        save_checkpoint_file(meta, staging / META_FILE)
        move_into_place(staging, path)
    strategy.barrier("fsdp_save_checkpoint")


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    process_group: ProcessGroup,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Read the sharded checkpoint at ``path`` into this run's shards (collective).

    Its ``state_dict`` and ``optimizer_states`` hold DTensors shaped like ``model``'s
    shards, whatever the number of ranks that wrote it. With ``weights_only`` (the
    default) nothing in the directory can run code: its metadata and non-tensor entries
    are read by `accord.engines.torch.safe_dcp`. Optimizer states are read only
    when the checkpoint has as many as ``optimizers``; otherwise they are empty
    placeholders and the Trainer reports the mismatch.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    from accord.engines.torch.safe_dcp import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        checkpoint_errors,
        load_metadata,
    )

    checkpoint = _read_meta(path, weights_only)
    options = state_dict_options(full=False)
    # DCP loads in place into tensors shaped like this run's shards.
    tensors: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    count = int(checkpoint.get("fsdp_sharded", {}).get("optimizer_count", 0))
    loadable = optimizers if count == len(optimizers) else []
    for index, optimizer in enumerate(loadable):
        tensors[f"optimizer_{index}"] = dict(
            get_optimizer_state_dict(model, optimizer, options=options)
        )
    if weights_only:
        # Every rank reads the same metadata, so a crafted file fails on all of them
        # here, before DCP's collective load could leave some ranks waiting.
        load_metadata((path / ".metadata").read_bytes(), str(path / ".metadata"))
        with checkpoint_errors("read", path):
            load(
                tensors,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(),
                process_group=process_group,
            )
    else:
        with checkpoint_errors("read", path):
            load(tensors, checkpoint_id=path, process_group=process_group)
    checkpoint["state_dict"] = tensors["model"]
    checkpoint["optimizer_states"] = [
        tensors.get(f"optimizer_{index}", {}) for index in range(count)
    ]
    return checkpoint


def read_sharded_whole(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Read the sharded checkpoint at ``path`` whole, in this process alone.

    Its ``state_dict`` holds the full tensors under the user's module's names and each of
    its ``optimizer_states`` is keyed by parameter name, as FSDP saves them; any number of
    ranks may have written it, and no process group is needed. With ``weights_only`` (the
    default) nothing in the directory can run code.

    Raises:
        CheckpointError: not a sharded accord checkpoint, or it holds objects beyond
            tensors and plain containers.
    """
    from accord.engines.torch.safe_dcp import read_whole

    checkpoint = _read_meta(path, weights_only)
    tensors = read_whole(str(path), weights_only=weights_only)
    count = int(checkpoint.get("fsdp_sharded", {}).get("optimizer_count", 0))
    checkpoint["state_dict"] = tensors.get("model", {})
    checkpoint["optimizer_states"] = [tensors.get(f"optimizer_{i}", {}) for i in range(count)]
    return checkpoint


def write_sharded_offline(checkpoint: dict[str, Any], path: Path, world_size: int = 1) -> Path:
    """Write a whole ``checkpoint`` as a sharded directory, in this process alone.

    No process group is needed: DCP writes each tensor whole, and an FSDP run at any world
    size reads the directory, each rank taking its shards (DCP reshards on load), as it
    reads one that FSDP wrote. ``optimizer_states`` must be keyed by parameter name, as
    FSDP keys them. ``world_size`` is recorded as the writer's. The directory is written
    under a staging name and renamed into place.

    Raises:
        CheckpointError: an optimizer state is numbered instead of keyed by name.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from accord.engines.torch.safe_dcp import checkpoint_errors

    tensors: dict[str, Any] = {"model": dict(checkpoint["state_dict"])}
    optimizer_states = checkpoint.get("optimizer_states", [])
    for index, state in enumerate(optimizer_states):
        names = [n for g in state.get("param_groups", []) for n in g.get("params", [])]
        if not all(isinstance(name, str) for name in names):
            raise CheckpointError(
                f"Optimizer state {index} is numbered, not keyed by parameter name; an FSDP "
                "directory needs the names. Name its parameters first."
            )
        tensors[f"optimizer_{index}"] = state
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["sharded"] = True
    meta["world_size"] = world_size
    meta["fsdp_sharded"] = {"optimizer_count": len(optimizer_states), "world_size": world_size}
    staging = staging_path(path)
    remove_checkpoint_path(staging)
    with checkpoint_errors("write", staging):
        save(tensors, storage_writer=FileSystemWriter(staging), no_dist=True)
    save_checkpoint_file(meta, staging / META_FILE)
    move_into_place(staging, path)
    return path


def _read_meta(path: Path, weights_only: bool) -> dict[str, Any]:
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"{str(path)!r} is a directory without {META_FILE}: not a sharded accord "
            "checkpoint (or one whose save did not finish)."
        )
    return load_checkpoint_file(path / META_FILE, weights_only=weights_only)


def name_parameters(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """``state`` with numbered parameters (a plain ``optimizer.state_dict()``, as DDP or
    one device save it) renamed to ``model``'s parameter names.

    Raises:
        CheckpointError: the state covers a different number of parameters.
    """
    groups = state.get("param_groups", [])
    if not groups or all(isinstance(i, str) for g in groups for i in g["params"]):
        return state
    # FSDP's optimizer states name parameters plainly, without torch.compile's parts.
    names = {id(p): plain_name(name) for name, p in model.named_parameters()}
    # optimizer.state_dict() numbers the parameters in the order of its param_groups.
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in groups):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {sum(len(g['params']) for g in groups)} "
            f"parameters, but this optimizer has {len(order)}."
        )
    return {
        "state": {order[int(i)]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in groups],
    }


register_directory_reader("fsdp_sharded", read_sharded_whole)
