"""Where a DeepSpeed save writes before its directory takes its final name.

A save to a path that holds no finished DeepSpeed checkpoint (a new path, a directory
without ``latest``, a single file) writes into `staging_path` beside it; once every rank's
shards and ``latest`` are on disk, `move_into_place` renames the staging directory to the
final name. A save that is killed midway so never leaves an incomplete directory under a
final name, where ``ckpt_path="last"`` would pick it; what it leaves behind is removed by
the next save into the same folder (`remove_leftovers`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection
from pathlib import Path

from accord.checkpoint_io import fsync_path

__all__ = ["fsync_tree", "move_into_place", "remove_leftovers", "staging_path"]

_SUFFIX = ".tmp"
_SCRIPT = ".py"
"""DeepSpeed copies its conversion scripts (``zero_to_fp32.py``) into every checkpoint."""


def staging_path(directory: Path) -> Path:
    """The staging directory of a save to ``directory``: ``.<name>.tmp`` beside it.

    Hidden, and without the ``.ckpt`` ending that ``ckpt_path="last"`` looks for.
    """
    return directory.with_name(f".{directory.name}{_SUFFIX}")


def remove_leftovers(folder: Path, tags: Collection[str]) -> None:
    """Delete the staging directories that killed saves left in ``folder``.

    A leftover is a directory named as `staging_path` names them that holds nothing but
    what a DeepSpeed save writes: directories named in ``tags``, ``latest`` (and the
    temporary file it is written through) and DeepSpeed's scripts. Anything else is
    not touched.
    """
    try:
        candidates = [p for p in folder.iterdir() if _is_staging_name(p.name)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for candidate in candidates:
        if _holds_only_a_save(candidate, tags):
            shutil.rmtree(candidate, ignore_errors=True)


def _is_staging_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(_SUFFIX) and len(name) > len(_SUFFIX) + 1


def _holds_only_a_save(directory: Path, tags: Collection[str]) -> bool:
    if directory.is_symlink() or not directory.is_dir():
        return False
    return all(_written_by_a_save(entry, tags) for entry in directory.iterdir())


def _written_by_a_save(entry: Path, tags: Collection[str]) -> bool:
    if entry.is_symlink():
        return False
    if entry.name in tags:
        return entry.is_dir()
    name = entry.name
    return entry.is_file() and (
        name == "latest" or name.startswith(".latest.") or name.endswith(_SCRIPT)
    )


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories themselves, to disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    fsync_path(directory.parent)


def move_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target`` and flush the rename to disk.

    What is at ``target`` (a file, or a directory without a finished checkpoint) is moved
    aside first and deleted once ``staging`` has its name.
    """
    aside = target.with_name(f".{target.name}.old")
    _remove(aside)
    if target.exists() or target.is_symlink():
        target.rename(aside)
    staging.rename(target)
    fsync_path(target.parent)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
