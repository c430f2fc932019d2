"""Checkpoints written completely, switched in atomically, then the old one removed.

A file is written to a temporary file beside its destination, flushed to disk and renamed
over it, so a crash mid-write leaves the previous checkpoint intact. A directory (an
engine's sharded checkpoint) is written under its `staging_path` and renamed into place by
`move_into_place`; a link by `link_atomically`. Every temporary name is hidden and derived
from the checkpoint's own, so `remove_leftovers` finds what a killed save left and
``ckpt_path="last"`` never takes it for a checkpoint.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from accord.checkpoint.formats import checkpoint_folders

__all__ = [
    "fsync_path",
    "fsync_tree",
    "link_atomically",
    "move_into_place",
    "remove_checkpoint_path",
    "remove_leftovers",
    "save_checkpoint_file",
    "staging_path",
    "write_bytes_atomically",
]


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


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories themselves, to disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    fsync_path(directory.parent)


def staging_path(target: Path) -> Path:
    """Where a checkpoint directory for ``target`` is written before it takes its name:
    ``.<name>.tmp`` beside it (hidden, and without the ending ``ckpt_path="last"`` looks
    for)."""
    return target.with_name(f".{target.name}.tmp")


def move_into_place(staging: Path, target: Path) -> None:
    """Rename the written directory ``staging`` to ``target`` and flush the rename to disk.

    What is at ``target`` (a file, a link, or a directory: the previous checkpoint) is
    first moved aside to ``.<name>.old`` and deleted once ``staging`` has the name, since a
    directory cannot be renamed over a non-empty one.
    """
    fsync_path(staging)  # its entries, before it takes the final name
    aside = target.with_name(f".{target.name}.old")
    _remove(aside)
    if target.exists() or target.is_symlink():
        target.rename(aside)
    staging.rename(target)
    fsync_path(target.parent)
    _remove(aside)


def link_atomically(target: Path, link: Path) -> None:
    """Make ``link`` a relative symbolic link to ``target``, switched in whole.

    The link is made under a hidden staging name and renamed over ``link``; a directory
    in the way (a sharded checkpoint) is first moved aside to ``.<name>.old``, removed
    once the link is in place. A reader of ``link`` finds the old checkpoint or the new
    one, never none while both exist.

    Raises:
        OSError: the filesystem has no symbolic links.
    """
    staged = link.with_name(f".{link.name}.{secrets.token_hex(4)}.tmp")
    staged.symlink_to(os.path.relpath(target, link.parent))
    aside = link.with_name(f".{link.name}.old")
    try:
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
            link.rename(aside)
        staged.replace(link)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)


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


def remove_leftovers(directory: Path, extension: str, depth: int) -> None:
    """Delete the staging files and directories a killed save left in ``directory`` (and
    its sub-directories down to ``depth``).

    Only hidden names derived from a checkpoint name: ``.<name>.tmp`` and
    ``.<name>.<random>.tmp`` (staged, never switched in), and ``.<name>.old`` once
    ``<name>`` exists again. Finished checkpoints are never touched.
    """
    ext = re.escape(extension)
    staged = re.compile(rf"\.(?P<name>.+{ext})\.(?:\w+\.)?tmp")
    moved_aside = re.compile(rf"\.(?P<name>.+{ext})\.old")
    for level in list(checkpoint_folders(directory, depth)):
        for entry in level.iterdir():
            if staged.fullmatch(entry.name) or (
                (match := moved_aside.fullmatch(entry.name))
                and (level / match.group("name")).exists()
            ):
                _remove(entry)


def _remove(path: Path) -> None:
    """Delete a file, a link or a directory tree; one that is already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
