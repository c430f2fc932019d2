"""The DeepSpeed checkpoint directory: atomic saves, safe loads, resume state, consolidation.

A checkpoint is a directory. ``engine.save_checkpoint`` writes every rank's shards under
``<dir>/<tag>/``, and ``<dir>/latest`` names the tag to read. `save_engine_checkpoint`
never leaves an incomplete checkpoint under a final name: a directory that holds no
finished checkpoint yet is written under a staging name and renamed into place when
complete (`accord.checkpoint.writing.move_into_place`); later saves to it take the tags
``checkpoint-0`` and ``checkpoint-1`` in turn, writing the tag ``latest`` does not name,
switching ``latest`` over atomically once every rank is done, and only then removing the
previous tag. The ranks keep step through the strategy's ``broadcast`` and ``barrier``,
that is, through its collective. Loading reads every file with ``weights_only=True``
(`accord.engines.deepspeed.checkpoint_reading`) unless the caller trusts the checkpoint.
`consolidate_deepspeed_checkpoint` turns a directory into one plain state dict file, offline;
`read_deepspeed_whole`, registered with `accord.checkpoint`, reads one whole (weights,
Trainer state and, for ZeRO-1/2, the merged optimizer state) so other strategies resume from it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, cast

from torch import nn

from accord.checkpoint.compiled_names import module_names
from accord.checkpoint.formats import check_format_version, checkpoint_format
from accord.checkpoint.reading import read_checkpoint, register_directory_reader
from accord.checkpoint.writing import (
    fsync_tree,
    move_into_place,
    save_checkpoint_file,
    staging_path,
    write_bytes_atomically,
)
from accord.core.strategy import Strategy
from accord.engines.deepspeed import zero_partitions
from accord.engines.deepspeed.checkpoint_reading import (
    check_tag_files,
    checkpoint_tag,
    consolidate,
    load_file,
    load_model_states,
    read_latest,
    safe_engine_loads,
)
from accord.engines.deepspeed.checkpoint_staging import remove_leftovers
from accord.errors import CheckpointError

__all__ = [
    "EngineState",
    "consolidate_deepspeed_checkpoint",
    "load_checkpoint_directory",
    "load_for_engine",
    "read_deepspeed_whole",
    "save_engine_checkpoint",
    "strip_step_prefix",
]

_TAGS = ("checkpoint-0", "checkpoint-1")
"""The tags a checkpoint directory's saves take in turn (``<dir>/<tag>/`` holds the files)."""

_CLIENT_KEY = "accord"
"""The key of the Trainer's state inside the engine's client state."""
_STEP_PREFIX = "module."
"""What `StepModule` puts before the user's parameter names."""
_ENGINE_KEYS = ("state_dict", "optimizer_states")
"""The parts of the Trainer's checkpoint the engine saves and restores itself."""


class EngineState(dict[str, Any]):
    """An empty placeholder for state the DeepSpeed engine saves or restores itself."""


def save_engine_checkpoint(
    strategy: Strategy, engine: Any, checkpoint: dict[str, Any], directory: Path
) -> None:
    """Write ``checkpoint`` into ``directory`` with ``engine.save_checkpoint``, atomically.

    Every rank must call it. Each rank writes its shards under ``<directory>/<tag>/`` and
    flushes them to disk; everything in ``checkpoint`` but ``state_dict`` and
    ``optimizer_states`` travels as the engine's client state. Global rank 0 picks the tag
    and, once every rank has written, points ``latest`` at it (and renames a staged
    directory into place); local rank 0 of each node clears what a killed save left first
    and removes the previous tag last.
    """
    tags = _next_tag(directory) if strategy.is_global_zero else None
    previous, tag = cast(tuple[str | None, str], strategy.broadcast(tags))
    target = directory if previous is not None else staging_path(directory)
    if strategy.local_rank == 0:
        remove_leftovers(directory.parent, _TAGS)
        shutil.rmtree(target / tag, ignore_errors=True)  # what a killed save left
    strategy.barrier("deepspeed_save_checkpoint_prepare")
    client = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
    client["sharded"] = True
    engine.save_checkpoint(
        str(target), tag=tag, client_state={_CLIENT_KEY: client}, save_latest=False
    )
    fsync_tree(target / tag)
    strategy.barrier("deepspeed_save_checkpoint_written")
    if strategy.is_global_zero:
        write_bytes_atomically(tag.encode(), target / "latest")
        if target != directory:
            move_into_place(target, directory)
        # Rewriting files inside leaves a directory's mtime alone; ckpt_path="last" reads it.
        os.utime(directory)
    strategy.barrier("deepspeed_save_checkpoint_committed")
    if previous is not None and previous != tag and strategy.local_rank == 0:
        shutil.rmtree(directory / previous, ignore_errors=True)


def load_checkpoint_directory(
    source: Path, engine: Any | None, *, weights_only: bool = True, checked: str | None = None
) -> dict[str, Any]:
    """Read the checkpoint directory ``source``; with a training ``engine``, to resume.

    With ``engine`` (every rank must call it) the engine restores its weights and optimizer
    state itself, and the returned ``state_dict`` and ``optimizer_states`` are
    `EngineState` placeholders. Without, the shards are consolidated into a full
    ``state_dict``, returned with the Trainer's state. With ``weights_only`` (the default)
    every file of the checkpoint is read as `load_deepspeed_file` reads it, so nothing in
    it can run code; pass False only for a checkpoint you trust. ``checked`` names a tag
    whose files the caller has just checked (`check_tag_files`): when ``latest`` still
    names it, they are not read a second time before the engine reads them.

    Raises:
        CheckpointError: no directory there, or not a finished DeepSpeed checkpoint; a
            file that holds objects ``weights_only`` refuses; resuming from a checkpoint
            without accord's training state.
    """
    if not source.is_dir():
        raise CheckpointError(
            f"No checkpoint at {str(source)!r}. Check the path, or pass ckpt_path='last' "
            "to resume from the latest checkpoint."
        )
    if engine is None:
        state, client = _read_consolidated(source, None, weights_only)
        return {**client, "state_dict": state}
    tag = checkpoint_tag(source, None)
    if weights_only and tag != checked:
        check_tag_files(source / tag)
    with safe_engine_loads(engine) if weights_only else contextlib.nullcontext():
        load_path, client = engine.load_checkpoint(
            str(source),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            custom_load_fn=_load_module_state,
        )
    if load_path is None or not isinstance(client, dict):
        raise CheckpointError(
            f"DeepSpeed could not load {str(source)!r} (no 'latest' file or tag directory)."
        )
    if _CLIENT_KEY not in client:
        raise CheckpointError(
            f"{str(source)!r} is a DeepSpeed checkpoint without accord's training state "
            "(loop position, callbacks); it cannot resume a fit. Evaluate from it, or "
            "consolidate it with consolidate_deepspeed_checkpoint() and load the weights."
        )
    checkpoint = dict(client[_CLIENT_KEY])
    check_format_version(checkpoint, source)
    checkpoint["state_dict"] = EngineState()
    checkpoint["optimizer_states"] = [EngineState()]
    return checkpoint


def _load_module_state(src: dict[str, Any], dst: nn.Module) -> None:
    """The engine's load of its own module state, strict, with the names matched to the
    module's (`accord.checkpoint.compiled_names.module_names`): a run with ``torch.compile``'d parts resumes
    from one without, and back."""
    dst.load_state_dict(module_names(dst, src), strict=True)


def load_for_engine(
    source: Path, engine: Any | None, rank: int, *, weights_only: bool = True
) -> dict[str, Any]:
    """Read any strategy's checkpoint for a DeepSpeed run; with a training ``engine``, to resume.

    A DeepSpeed checkpoint of the engine's ZeRO stage and world size is restored by the
    engine itself (`load_checkpoint_directory`). Any other (a file, an FSDP directory,
    another stage or world size) is read whole, and its optimizer state is put into the
    ZeRO-1/2 engine's partitions here: this rank's slice of each group's flat buffer, for
    every per-parameter tensor (Adam's moments), with the step and the group's settings.
    Its ``state_dict`` stays full, for `DeepSpeedStrategy.load_module_state_dict`; its
    ``optimizer_states`` become `EngineState` placeholders. Every rank must call it.

    Raises:
        CheckpointError: nothing readable at ``source``; a ZeRO-3 run resuming from
            another layout; an optimizer state that does not fit the engine's groups.
    """
    if source.is_dir() and engine is None:
        return load_checkpoint_directory(source, None, weights_only=weights_only)
    native = _native_tag(engine, source, weights_only) if source.is_dir() else None
    if native is not None:
        return load_checkpoint_directory(source, engine, weights_only=weights_only, checked=native)
    checkpoint = read_checkpoint(source, weights_only=weights_only)
    if engine is None:
        return checkpoint
    states = checkpoint.get("optimizer_states", [])
    for state in states:
        zero_partitions.put_optimizer_state(engine, state, rank, source)
    checkpoint["optimizer_states"] = [EngineState() for _ in states]
    return checkpoint


def _native_tag(engine: Any, source: Path, weights_only: bool) -> str | None:
    """The tag to restore when ``source`` is a DeepSpeed checkpoint the engine restores
    itself (same ZeRO stage, same number of ranks), else None. With ``weights_only`` the
    tag's files are checked (`check_tag_files`) first."""
    if checkpoint_format(source) != "deepspeed":
        return None
    tag = checkpoint_tag(source, None)
    if weights_only:
        check_tag_files(source / tag)
    # Only the settings stored beside the weights are read: the weights stay on disk.
    states = load_model_states(source, tag, weights_only, mmap=True)
    stage = states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0)
    native = int(stage) == int(engine.zero_optimization_stage()) and int(
        states.get("dp_world_size", -1)
    ) == int(engine.dp_world_size)
    return tag if native else None


def strip_step_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Names as in the user's module (drop `StepModule`'s ``module.``)."""
    return {
        (key[len(_STEP_PREFIX) :] if key.startswith(_STEP_PREFIX) else key): value
        for key, value in state.items()
    }


def _read_consolidated(
    directory: Path, tag: str | None, weights_only: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ZeRO checkpoint's full fp32 state dict and the Trainer state stored beside it.

    The state dict has the user's parameter names when accord wrote the checkpoint; the
    Trainer state is empty for a checkpoint DeepSpeed wrote for someone else. DeepSpeed's
    ``zero_to_fp32`` unpickles the files itself, so with ``weights_only`` they are all
    read as `load_deepspeed_file` reads them first.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CheckpointError: ``directory`` is not a readable DeepSpeed checkpoint.
    """
    if not directory.is_dir():
        raise CheckpointError(f"{str(directory)!r} is not a DeepSpeed checkpoint directory.")
    tag = checkpoint_tag(directory, tag)
    if weights_only:
        check_tag_files(directory / tag)
    state = consolidate(directory, tag)
    states = load_model_states(directory, tag, weights_only)
    if _CLIENT_KEY not in states:
        return state, {}
    return strip_step_prefix(state), dict(states[_CLIENT_KEY])


def read_deepspeed_whole(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Read the DeepSpeed checkpoint directory ``path`` whole, in this process alone.

    Registered with `accord.checkpoint`, so DDP, one device and FSDP resume from it. Its
    ``state_dict`` holds the full fp32 weights under the user's module's names; its one
    optimizer state is every rank's partition (ZeRO-1, 2 or 3) merged into a plain
    ``optimizer.state_dict()`` (`accord.engines.deepspeed.zero_partitions`). With ``weights_only``
    (the default) nothing in the directory can run code.

    Raises:
        CheckpointError: not a finished DeepSpeed checkpoint; one from a newer accord; a
            file that holds objects ``weights_only`` refuses; optimizer partitions that do
            not fit the parameters.
    """
    tag = checkpoint_tag(path, None)
    if weights_only:
        check_tag_files(path / tag)
    states = load_model_states(path, tag, weights_only)
    checkpoint = dict(states.get(_CLIENT_KEY, {}))
    check_format_version(checkpoint, path)
    weights = consolidate(path, tag)
    checkpoint["state_dict"] = strip_step_prefix(weights) if _CLIENT_KEY in states else weights
    optimizers = [
        load_file(file, weights_only) for file in zero_partitions.optimizer_files(path / tag)
    ]
    try:
        partitions = [loaded["optimizer_state_dict"] for loaded in optimizers]
        stage = int(partitions[0]["zero_stage"])
        # ZeRO-3 keeps the base optimizer's state under another key than ZeRO-1/2.
        key = "optimizer_state_dict" if stage >= 3 else "base_optimizer_state"
        base = [partition[key] for partition in partitions]
        merge = (
            zero_partitions.merge_zero3_optimizer_states
            if stage >= 3
            else zero_partitions.merge_zero_optimizer_states
        )
        merged = merge(states["param_shapes"], base, path)
    except (KeyError, TypeError, IndexError) as err:
        raise CheckpointError(
            f"{str(path / tag)!r} holds ZeRO optimizer states in a layout this accord does "
            f"not read (missing {err}); resume from it with a DeepSpeed strategy."
        ) from err
    checkpoint["optimizer_states"] = [merged]
    return checkpoint


def consolidate_deepspeed_checkpoint(
    checkpoint_dir: str | Path,
    output_file: str | Path,
    *,
    tag: str | None = None,
    weights_only: bool = True,
) -> Path:
    """Turn a ZeRO checkpoint directory into one plain fp32 state dict file.

    Works offline, in one process: the shards every rank wrote are merged with DeepSpeed's
    ``zero_to_fp32`` utilities. The file holds the model's state dict (parameter names as
    in the user's module), so ``model.load_state_dict(torch.load(output_file))`` works
    without DeepSpeed.

    Args:
        checkpoint_dir: a directory `DeepSpeedStrategy.save_checkpoint` (or DeepSpeed's
            ``engine.save_checkpoint``) wrote.
        output_file: where to write the state dict (atomically).
        tag: the tag inside ``checkpoint_dir``; default: its ``latest`` file.
        weights_only: read every file with ``torch.load(weights_only=True)``, admitting
            only the few DeepSpeed classes its files hold, so nothing in the directory
            can run code. Pass False only for a checkpoint you trust.

    Returns:
        ``output_file`` as a `Path`.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CheckpointError: ``checkpoint_dir`` is not a DeepSpeed checkpoint, or (with
            ``weights_only``) a file in it holds other objects; the message names them.
    """
    state, _ = _read_consolidated(Path(checkpoint_dir), tag, weights_only)
    return save_checkpoint_file(state, output_file)


def _next_tag(directory: Path) -> tuple[str | None, str]:
    """The tag ``latest`` names now (None: no finished checkpoint there) and the tag the
    next save writes."""
    previous = read_latest(directory)
    return previous, _TAGS[1] if previous == _TAGS[0] else _TAGS[0]


register_directory_reader("deepspeed", read_deepspeed_whole)
