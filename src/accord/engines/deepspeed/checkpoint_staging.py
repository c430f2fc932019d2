"""The staging directories that killed DeepSpeed saves left, found and removed.

A save to a path that holds no finished DeepSpeed checkpoint (a new path, a directory
without ``latest``, a single file) writes into the staging directory beside it
(`accord.checkpoint.writing.staging_path`); once every rank's shards and ``latest`` are on
disk, `accord.checkpoint.writing.move_into_place` gives it the final name. A save that is
killed midway so never leaves an incomplete directory under a final name, where
``ckpt_path="last"`` would pick it; what it leaves behind is removed by the next save into
the same folder (`remove_leftovers`), whatever the checkpoint's name ends with.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path

__all__ = ["remove_leftovers"]

_SUFFIX = ".tmp"
_SCRIPT = ".py"
"""DeepSpeed copies its conversion scripts (``zero_to_fp32.py``) into every checkpoint."""


def remove_leftovers(folder: Path, tags: Collection[str]) -> None:
    """Delete the staging directories that killed saves left in ``folder``.

    A leftover is a directory named as `accord.checkpoint.writing.staging_path` names them that holds nothing but
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
