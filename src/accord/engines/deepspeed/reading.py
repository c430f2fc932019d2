"""Reading a DeepSpeed checkpoint directory's files.

The tag ``<dir>/latest`` names, the checkpoint's model states file, any one file (safely,
with ``weights_only``), and the full fp32 weights ``zero_to_fp32`` consolidates from the
shards. `accord.engines.deepspeed.checkpoint` builds its loads on these.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from accord.compiled import plain_names
from accord.engines.deepspeed.safe_load import load_deepspeed_file
from accord.errors import CheckpointError
from accord.imports import import_optional

__all__ = ["checkpoint_tag", "consolidate", "load_file", "load_model_states", "read_latest"]


def read_latest(directory: Path) -> str | None:
    """The tag a checkpoint directory's ``latest`` file names, or None without one."""
    try:
        return (directory / "latest").read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def consolidate(directory: Path, tag: str) -> dict[str, Any]:
    """The tag's full fp32 weights, merged from every rank's shards, under plain names
    (`accord.compiled.plain_names`)."""
    zero_to_fp32 = import_optional(
        "deepspeed.utils.zero_to_fp32", "consolidate_deepspeed_checkpoint"
    )
    try:
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{str(directory)!r} could not be consolidated (not a ZeRO checkpoint?): {err}"
        ) from err
    # ZeRO names the parameters as the engine's module does, compiled parts included.
    return plain_names(dict(state))


def checkpoint_tag(directory: Path, tag: str | None) -> str:
    found = tag if tag is not None else read_latest(directory)
    if found is None:
        raise CheckpointError(
            f"{str(directory)!r} is not a DeepSpeed checkpoint: it has no 'latest' file (a "
            "save that did not finish leaves none). Pass tag= to name the tag directory to read."
        )
    if not (directory / found).is_dir():
        raise CheckpointError(
            f"{str(directory)!r} is not a complete DeepSpeed checkpoint: it has no tag "
            f"directory {found!r}."
        )
    return found


def load_model_states(
    directory: Path, tag: str, weights_only: bool, *, mmap: bool = False
) -> dict[str, Any]:
    """The tag's model states file (``mmap``: its tensors mapped, not read; for a caller
    that only reads the settings stored beside the weights)."""
    files = sorted((directory / tag).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{str(directory / tag)!r} holds no DeepSpeed model states file (*model_states.pt)."
        )
    return load_file(files[0], weights_only, mmap=mmap)


def load_file(file: Path, weights_only: bool, *, mmap: bool = False) -> dict[str, Any]:
    """One file of a checkpoint, which must hold a dict (``mmap`` as `load_deepspeed_file`)."""
    if weights_only:
        loaded = load_deepspeed_file(file, mmap=mmap)
    else:
        try:
            mapped = mmap and zipfile.is_zipfile(file)
            loaded = torch.load(file, map_location="cpu", weights_only=False, mmap=mapped)
        except Exception as err:
            raise CheckpointError(f"{str(file)!r} is not readable: {err}") from err
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{str(file)!r} holds a {type(loaded).__name__}, not a dict.")
    return loaded
