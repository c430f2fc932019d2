"""Checkpoint files: written atomically, read safely; checkpoint directories recognized.

A checkpoint is written to a temporary file beside its destination, flushed to disk and
renamed over it, so a crash mid-write leaves the previous checkpoint intact. Reading uses
``torch.load(weights_only=True)`` unless the caller opts out for a file they trust.

A sharding strategy writes a directory instead: FSDP's sharded checkpoints
(`torch.distributed.checkpoint`) and DeepSpeed's ZeRO checkpoints. `checkpoint_format` tells
them apart by the files inside; the engine that owns a format registers a reader with
`register_directory_reader`, and `read_checkpoint` reads a file or any registered directory
as one full checkpoint dict, so a strategy that does not shard resumes from either.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from accord.compiled import plain_names
from accord.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "DIRECTORY_FORMATS",
    "DirectoryReader",
    "check_format_version",
    "checkpoint_format",
    "fsync_path",
    "load_checkpoint_file",
    "read_checkpoint",
    "register_directory_reader",
    "remove_checkpoint_path",
    "save_checkpoint_file",
    "write_bytes_atomically",
]

CHECKPOINT_FORMAT_VERSION = 1
"""The newest ``accord_checkpoint_version`` this accord reads; a newer checkpoint is refused."""

DIRECTORY_FORMATS: dict[str, str] = {
    "fsdp_sharded": "an FSDP sharded checkpoint (a torch.distributed.checkpoint directory)",
    "deepspeed": "a DeepSpeed checkpoint (ZeRO shards under a tag directory)",
}
"""The checkpoint directory formats `checkpoint_format` recognizes, with what each is."""

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


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | Path) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temporary file, fsync, rename)."""
    return _write_atomically(path, lambda handle: torch.save(checkpoint, handle))


def write_bytes_atomically(data: bytes, path: str | Path) -> Path:
    """Write ``data`` to ``path`` as `save_checkpoint_file` writes a checkpoint.

    For the small files that point into a checkpoint (such as DeepSpeed's ``latest``), so
    a reader finds the old contents or the new ones, never a part.
    """
    return _write_atomically(path, lambda handle: handle.write(data))


def _write_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
    return target


def remove_checkpoint_path(path: str | Path) -> None:
    """Delete a checkpoint file or directory, if there is one.

    A directory is first renamed to a hidden ``.<name>.removing.tmp``, so a crash in the
    middle of the delete never leaves part of a checkpoint under its own name; the next
    save's clean-up removes what is left.
    """
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        doomed = target.with_name(f".{target.name}.removing.tmp")
        shutil.rmtree(doomed, ignore_errors=True)
        target.rename(doomed)
        shutil.rmtree(doomed)
    else:
        target.unlink(missing_ok=True)


def fsync_path(path: str | Path) -> None:
    """Flush a file, or a directory's entries (so a rename in it is durable), to disk.

    Best effort: a filesystem that cannot open the path read-only, or flush it, is left as is.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        refused = _REFUSED_GLOBAL.findall(str(err))
        if weights_only and refused:
            raise CheckpointError(
                f"{str(source)!r} holds objects that weights_only=True refuses to unpickle: "
                f"{', '.join(sorted(set(refused)))}. Unpickling them would run their code. "
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


def checkpoint_format(path: str | Path) -> str | None:
    """What ``path`` holds: ``"file"``, a key of `DIRECTORY_FORMATS`, or None (nothing
    accord recognizes: missing, or a directory of something else)."""
    source = Path(path)
    if source.is_file():
        return "file"
    if not source.is_dir():
        return None
    if (source / ".metadata").is_file():
        return "fsdp_sharded"
    if (source / "latest").is_file() or any(source.glob("*/*model_states.pt")):
        return "deepspeed"
    return None


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


def check_format_version(checkpoint: dict[str, Any], source: str | Path) -> None:
    """Refuse a checkpoint written in a newer format than `CHECKPOINT_FORMAT_VERSION`.

    Raises:
        CheckpointError: its ``accord_checkpoint_version`` is newer, or not a number.
    """
    version = checkpoint.get("accord_checkpoint_version", CHECKPOINT_FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(
            f"{str(source)!r} has format version {version!r}, not a number: it is not a "
            "checkpoint accord wrote, or it was altered."
        )
    if version > CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{str(source)!r} was written by a newer accord (checkpoint format version "
            f"{version}); this one reads versions up to {CHECKPOINT_FORMAT_VERSION}. "
            "Upgrade accord to load it."
        )


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
