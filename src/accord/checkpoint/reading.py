"""Checkpoints read safely: one file, or an engine's directory whole.

Reading uses ``torch.load(weights_only=True)`` unless the caller opts out for a file they
trust, and a file that is no checkpoint (empty, text, truncated, a directory) is refused
with a message that says what it is. The engine that owns a directory format
(`accord.checkpoint.formats.DIRECTORY_FORMATS`) registers a reader with
`register_directory_reader`, and `read_checkpoint` reads a file or any registered directory
as one full checkpoint dict, so a strategy that does not shard resumes from either.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accord.checkpoint.compiled_names import plain_names
from accord.checkpoint.formats import DIRECTORY_FORMATS, check_format_version, checkpoint_format
from accord.errors import CheckpointError

__all__ = [
    "DirectoryReader",
    "load_checkpoint_file",
    "read_checkpoint",
    "refused_globals",
    "register_directory_reader",
]

_HOW_TO_READ = {
    "fsdp_sharded": (
        "Resume from it with any strategy (ckpt_path=...), or read it into one file with "
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save."
    ),
    "deepspeed": (
        "Resume from it with any strategy (ckpt_path=...; the optimizer state comes along), "
        "turn it into one file with python -m accord.checkpoint convert SRC DST --to full, "
        "or into one file of weights with "
        "accord.strategies.consolidate_deepspeed_checkpoint(directory, file)."
    ),
}

DirectoryReader = Callable[[Path, bool], dict[str, Any]]
"""Reads a checkpoint directory (``path``, ``weights_only``) into one full checkpoint dict:
``state_dict`` and ``optimizer_states`` hold whole tensors, keyed as the user's module and a
plain ``optimizer.state_dict()`` (or by parameter name) key them."""

_READERS: dict[str, DirectoryReader] = {}

# torch.load names each global its weights-only unpickler refuses as "GLOBAL module.name".
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = b"\x80"


def load_checkpoint_file(
    path: str | Path, *, weights_only: bool = True, map_location: Any = "cpu"
) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint_file`.

    Args:
        path: the checkpoint file.
        weights_only: as in `torch.load`: only tensors and plain containers are unpickled.
            Pass False only for a file you trust that holds other objects.
        map_location: where tensors are loaded (default: CPU).

    Raises:
        CheckpointError: the file is missing, truncated, corrupt, or not a checkpoint dict;
            a directory (the message says which format it holds and how to load it); a
            checkpoint written in a newer format than `CHECKPOINT_FORMAT_VERSION`.
    """
    source = Path(path)
    if source.is_dir():
        found = checkpoint_format(source) or ""
        what = DIRECTORY_FORMATS.get(found, "no format accord knows")
        how = _HOW_TO_READ.get(found, "Pass the path of a checkpoint file.")
        raise CheckpointError(
            f"{str(source)!r} is a directory, not a checkpoint file: it holds {what}. {how}"
        )
    if not source.is_file():
        raise CheckpointError(
            f"No checkpoint at {str(source)!r}. Check the path, or pass ckpt_path='last' to "
            "resume from the latest checkpoint."
        )
    _check_header(source)
    try:
        loaded = torch.load(source, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        refused = refused_globals(err)
        if weights_only and refused:
            raise CheckpointError(
                f"{str(source)!r} holds objects that weights_only=True refuses to unpickle: "
                f"{', '.join(refused)}. Unpickling them would run their code. "
                "Only if you trust the file and where it came from, load it with "
                "weights_only=False."
            ) from err
        raise CheckpointError(
            f"{str(source)!r} is not a checkpoint written by torch.save (or it is corrupt): "
            f"{_unpickler_reason(err)}"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{str(source)!r} is not a readable checkpoint (corrupt or truncated?): {err}"
        ) from err
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{str(source)!r} holds a {type(loaded).__name__}, not a checkpoint dict."
        )
    check_format_version(loaded, source)
    return loaded


def register_directory_reader(format_name: str, reader: DirectoryReader) -> None:
    """Let `read_checkpoint` read directories of ``format_name`` with ``reader``.

    Called by the engine that owns the format, when it is imported.

    Raises:
        ValueError: ``format_name`` is not one of `DIRECTORY_FORMATS`.
    """
    if format_name not in DIRECTORY_FORMATS:
        raise ValueError(
            f"Unknown checkpoint directory format {format_name!r}; known: "
            f"{', '.join(sorted(DIRECTORY_FORMATS))}."
        )
    _READERS[format_name] = reader


def read_checkpoint(path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Read a checkpoint file, or a checkpoint directory whose format has a reader, whole.

    Args:
        path: a checkpoint file, or a directory a sharding strategy wrote.
        weights_only: as in `torch.load`, for every file read.

    Raises:
        CheckpointError: nothing readable at ``path``, or a format without a reader.
    """
    source = Path(path)
    found = checkpoint_format(source)
    if found is None or found == "file":
        return _plain_model_state(load_checkpoint_file(source, weights_only=weights_only))
    reader = _READERS.get(found)
    if reader is None:
        raise CheckpointError(
            f"{str(source)!r} is {DIRECTORY_FORMATS[found]}, which this installation cannot "
            f"read outside its own strategy. {_HOW_TO_READ[found]}"
        )
    checkpoint = reader(source, weights_only)
    check_format_version(checkpoint, source)
    return _plain_model_state(checkpoint)


def _plain_model_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its model state under plain parameter names (one written before
    accord stripped the names ``torch.compile`` adds reads as one written since)."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if isinstance(state, dict):
        checkpoint["state_dict"] = plain_names(state)
    return checkpoint


def refused_globals(error: BaseException) -> list[str]:
    """The globals (``module.name``) that ``torch.load``'s weights-only unpickler refused,
    by the message of its ``error``, sorted and each once; empty for another error."""
    return sorted(set(_REFUSED_GLOBAL.findall(str(error))))


def _check_header(source: Path) -> None:
    """Refuse a file that is neither torch's zip format nor a pickle, before unpickling it."""
    with source.open("rb") as handle:
        head = handle.read(4)
    if not head:
        raise CheckpointError(f"{str(source)!r} is empty: not a checkpoint (a save cut short?).")
    if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_PROTO):
        return
    what = "it holds text" if _looks_like_text(source) else "or it is corrupt: binary data"
    raise CheckpointError(
        f"{str(source)!r} is not a checkpoint ({what} starting {head!r}, not what torch.save "
        "writes). Pass the path of a .ckpt file that accord or torch.save wrote."
    )


def _looks_like_text(source: Path) -> bool:
    with source.open("rb") as handle:
        sample = handle.read(512)
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _unpickler_reason(err: BaseException) -> str:
    """The reason torch.load's unpickler gave, without its advice to drop weights_only."""
    text = str(err)
    _, found, reason = text.partition("WeightsUnpickler error:")
    if found:
        text = reason.partition("Check the documentation")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
