"""Checkpoint files: written atomically, read safely.

A checkpoint is written to a temporary file beside its destination, flushed to disk and
renamed over it, so a crash mid-write leaves the previous checkpoint intact. Reading uses
``torch.load(weights_only=True)`` unless the caller opts out for a file they trust.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from accord.errors import CheckpointError

__all__ = ["load_checkpoint_file", "save_checkpoint_file", "write_bytes_atomically"]

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
    _fsync_dir(target.parent)
    return target


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem allows opening a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
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
        CheckpointError: the file is missing, truncated, corrupt, or not a checkpoint dict.
    """
    source = Path(path)
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
    return loaded


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
