"""What a checkpoint is on disk: its format version, file or directory format, and whether
its save finished.

A checkpoint is one file (`accord.checkpoint.writing.save_checkpoint_file`) or a directory
a sharding strategy writes: FSDP's sharded checkpoints (`torch.distributed.checkpoint`)
and DeepSpeed's ZeRO checkpoints. `checkpoint_format` tells them apart by the files
inside; `is_finished_checkpoint` by the file each writer writes last, so a save that was
cut short is never taken for a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from accord.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "DIRECTORY_FORMATS",
    "check_format_version",
    "checkpoint_folders",
    "checkpoint_format",
    "finished_checkpoints",
    "is_finished_checkpoint",
]

CHECKPOINT_FORMAT_VERSION = 1
"""The newest ``accord_checkpoint_version`` this accord reads; a newer checkpoint is refused.
The Trainer writes it into every checkpoint."""

DIRECTORY_FORMATS: dict[str, str] = {
    "fsdp_sharded": "an FSDP sharded checkpoint (a torch.distributed.checkpoint directory)",
    "deepspeed": "a DeepSpeed checkpoint (ZeRO shards under a tag directory)",
}
"""The checkpoint directory formats `checkpoint_format` recognizes, with what each is."""

_WRITTEN_LAST: dict[str, str] = {"fsdp_sharded": "accord_meta.pt", "deepspeed": "latest"}
"""The file the writer of each directory format writes last: once it is there, the save
finished."""


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


def is_finished_checkpoint(entry: Path) -> bool:
    """Whether ``entry`` is a checkpoint whose save finished.

    A file is (files are renamed into place whole), a hidden name never is (a save's
    staging). A directory is once the file its writer writes last is there: FSDP's
    ``accord_meta.pt``, DeepSpeed's ``latest``. A link is what it points to.
    """
    if entry.name.startswith("."):
        return False
    if entry.is_file():
        return True
    return entry.is_dir() and any((entry / name).is_file() for name in _WRITTEN_LAST.values())


def finished_checkpoints(directories: Iterable[Path], extension: str, depth: int) -> list[Path]:
    """The finished checkpoints (``*<extension>``) in ``directories``, and in their
    sub-directories down to ``depth`` levels (names with a ``/``, such as a metric
    ``val/loss``, put checkpoints there)."""
    found: list[Path] = []
    for directory in dict.fromkeys(directories):
        for level in checkpoint_folders(directory, depth):
            found += [
                entry for entry in level.glob(f"*{extension}") if is_finished_checkpoint(entry)
            ]
    return found


def checkpoint_folders(directory: Path, depth: int) -> Iterator[Path]:
    """``directory`` and its visible sub-directories down to ``depth`` levels, skipping
    links and hidden names (a save's staging); nothing when ``directory`` is missing."""
    if not directory.is_dir():
        return
    yield directory
    if depth <= 0:
        return
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.name.startswith(".") and not entry.is_symlink():
            yield from checkpoint_folders(entry, depth - 1)
