"""The DeepSpeed checkpoint directory: atomic tag/latest saves, resume state, consolidation.

A checkpoint is a directory. ``engine.save_checkpoint`` writes every rank's shards under
``<dir>/<tag>/``, and ``<dir>/latest`` names the tag to read. Saves to one directory take
the tags ``checkpoint-0`` and ``checkpoint-1`` in turn: `save_engine_checkpoint` writes
the tag ``latest`` does not name, switches ``latest`` over atomically once every rank is
done, and only then removes the previous tag, so a save that dies midway leaves the
previous checkpoint whole. The ranks keep step through the strategy's ``broadcast`` and
``barrier``, that is, through its collective. `consolidate_deepspeed_checkpoint` turns a
directory into one plain state dict file, offline.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from accord.checkpoint_io import save_checkpoint_file, write_bytes_atomically
from accord.core.strategy import Strategy
from accord.engines.deepspeed.collective import import_deepspeed
from accord.errors import CheckpointError

__all__ = [
    "EngineState",
    "consolidate_deepspeed_checkpoint",
    "load_checkpoint_directory",
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

    Every rank must call it. Each rank writes its shards under ``<directory>/<tag>/``;
    everything in ``checkpoint`` but ``state_dict`` and ``optimizer_states`` travels as
    the engine's client state. Global rank 0 picks the tag and points ``latest`` at it once
    every rank has written; local rank 0 of each node clears the tag first and removes the
    previous one last.
    """
    tags = _next_tag(directory) if strategy.is_global_zero else None
    previous, tag = cast(tuple[str | None, str], strategy.broadcast(tags))
    if strategy.local_rank == 0:
        shutil.rmtree(directory / tag, ignore_errors=True)  # what a crashed save left
    strategy.barrier("deepspeed_save_checkpoint_prepare")
    client = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
    engine.save_checkpoint(
        str(directory), tag=tag, client_state={_CLIENT_KEY: client}, save_latest=False
    )
    strategy.barrier("deepspeed_save_checkpoint_written")
    if strategy.is_global_zero:
        write_bytes_atomically(tag.encode(), directory / "latest")
        # Rewriting files inside leaves a directory's mtime alone; ckpt_path="last" reads it.
        os.utime(directory)
    strategy.barrier("deepspeed_save_checkpoint_committed")
    if previous is not None and previous != tag and strategy.local_rank == 0:
        shutil.rmtree(directory / previous, ignore_errors=True)


def load_checkpoint_directory(source: Path, engine: Any | None) -> dict[str, Any]:
    """Read the checkpoint directory ``source``; with a training ``engine``, to resume.

    With ``engine`` (every rank must call it) the engine restores its weights and optimizer
    state itself, and the returned ``state_dict`` and ``optimizer_states`` are
    `EngineState` placeholders. Without, the shards are consolidated into a full
    ``state_dict``, returned with the Trainer's state.

    Raises:
        CheckpointError: no directory there, or not a DeepSpeed checkpoint; resuming from
            one without accord's training state.
    """
    if not source.is_dir():
        raise CheckpointError(
            f"No checkpoint at {str(source)!r}. Check the path, or pass ckpt_path='last' "
            "to resume from the latest checkpoint."
        )
    if engine is None:
        state, client = _read_consolidated(source, None)
        return {**client, "state_dict": state}
    load_path, client = engine.load_checkpoint(
        str(source), load_optimizer_states=True, load_lr_scheduler_states=False
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
    checkpoint["state_dict"] = EngineState()
    checkpoint["optimizer_states"] = [EngineState()]
    return checkpoint


def _read_latest(directory: Path) -> str | None:
    """The tag a checkpoint directory's ``latest`` file names, or None without one."""
    try:
        return (directory / "latest").read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def strip_step_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Names as in the user's module (drop `StepModule`'s ``module.``)."""
    return {
        (key[len(_STEP_PREFIX) :] if key.startswith(_STEP_PREFIX) else key): value
        for key, value in state.items()
    }


def _read_consolidated(directory: Path, tag: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ZeRO checkpoint's full fp32 state dict and the Trainer state stored beside it.

    The state dict has the user's parameter names when accord wrote the checkpoint; the
    Trainer state is empty for a checkpoint DeepSpeed wrote for someone else.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CheckpointError: ``directory`` is not a readable DeepSpeed checkpoint.
    """
    if not directory.is_dir():
        raise CheckpointError(f"{str(directory)!r} is not a DeepSpeed checkpoint directory.")
    tag = _checkpoint_tag(directory, tag)
    zero_to_fp32 = import_deepspeed(
        "deepspeed.utils.zero_to_fp32", feature="consolidate_deepspeed_checkpoint"
    )
    try:
        state = dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag))
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{str(directory)!r} could not be consolidated (not a ZeRO checkpoint?): {err}"
        ) from err
    states = _load_model_states(directory, tag)
    if _CLIENT_KEY not in states:
        return state, {}
    return strip_step_prefix(state), dict(states[_CLIENT_KEY])


def consolidate_deepspeed_checkpoint(
    checkpoint_dir: str | Path, output_file: str | Path, *, tag: str | None = None
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

    Returns:
        ``output_file`` as a `Path`.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CheckpointError: ``checkpoint_dir`` is not a DeepSpeed checkpoint.
    """
    state, _ = _read_consolidated(Path(checkpoint_dir), tag)
    return save_checkpoint_file(state, output_file)


def _next_tag(directory: Path) -> tuple[str | None, str]:
    """The tag ``latest`` names now (or None) and the tag the next save writes.

    A single-file checkpoint at ``directory`` (from an earlier evaluation run) is removed.
    """
    if directory.is_file():
        directory.unlink()
    previous = _read_latest(directory)
    return previous, _TAGS[1] if previous == _TAGS[0] else _TAGS[0]


def _checkpoint_tag(directory: Path, tag: str | None) -> str:
    found = tag if tag is not None else _read_latest(directory)
    if found is None:
        raise CheckpointError(
            f"{str(directory)!r} is not a DeepSpeed checkpoint: it has no 'latest' file (a "
            "save that did not finish leaves none). Pass tag= to name the tag directory to read."
        )
    return found


def _load_model_states(directory: Path, tag: str) -> dict[str, Any]:
    files = sorted((directory / tag).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{str(directory / tag)!r} holds no DeepSpeed model states file (*model_states.pt)."
        )
    try:
        # DeepSpeed's own files hold pickled config objects; DeepSpeed reads them so too.
        loaded = torch.load(files[0], map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{str(files[0])!r} is not readable: {err}") from err
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{str(files[0])!r} holds a {type(loaded).__name__}, not a dict.")
    return loaded
