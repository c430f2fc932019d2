"""Reading a DeepSpeed checkpoint directory's files, without running code from them.

DeepSpeed reads its own files with ``torch.load(weights_only=False)``, so a crafted file
in a checkpoint directory would run its code on load. Here every file is read with
``weights_only=True``, which admits tensors, plain containers and, besides, only the
DeepSpeed classes its files hold (`deepspeed_safe_globals`):

- `check_tag_files` reads every file of a tag on every rank before anything is loaded, so
  a crafted file is refused on all ranks alike, before DeepSpeed's collective load could
  leave some ranks waiting for the others;
- `safe_engine_loads` routes the loads of ``engine.load_checkpoint`` through
  `load_deepspeed_file`.

The directory's parts are read here too: the tag ``<dir>/latest`` names
(`checkpoint_tag`), the tag's model states file, any one file (safely, with
``weights_only``), and the full fp32 weights ``zero_to_fp32`` consolidates from the shards.
`accord.engines.deepspeed.checkpoint_directory` builds its saves and loads on these.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accord.checkpoint.compiled_names import plain_names
from accord.checkpoint.reading import refused_globals
from accord.errors import CheckpointError
from accord.imports import import_optional

__all__ = [
    "check_tag_files",
    "checkpoint_tag",
    "consolidate",
    "deepspeed_safe_globals",
    "load_deepspeed_file",
    "load_file",
    "load_model_states",
    "read_latest",
    "safe_engine_loads",
]


def deepspeed_safe_globals() -> list[Any]:
    """The DeepSpeed classes its checkpoint files hold besides tensors and containers.

    A ZeRO optimizer state holds its loss scaler (``LossScaler``, or ``DynamicLossScaler``
    under fp16), the stage as a ``ZeroStageEnum`` and, at stages 1 and 2, the
    ``fragment_address`` of each parameter slice. Rebuilding one sets its attributes and
    calls nothing else.
    """
    feature = "reading DeepSpeed checkpoints"
    scaler = import_optional("deepspeed.runtime.fp16.loss_scaler", feature)
    zero_config = import_optional("deepspeed.runtime.zero.config", feature)
    fragment = import_optional("deepspeed.utils.tensor_fragment", feature)
    return [
        scaler.LossScaler,
        scaler.DynamicLossScaler,
        zero_config.ZeroStageEnum,
        fragment.fragment_address,
    ]


def load_deepspeed_file(path: str | Path, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` one DeepSpeed file with ``weights_only=True`` and DeepSpeed's safe globals.

    Args:
        path: the file.
        map_location: as in `torch.load`.
        mmap: map the tensors' storage instead of reading it (files in torch's zip format;
            others are read whole).

    Raises:
        CheckpointError: the file holds other objects (the message names them), or it is
            not a readable torch file.
    """
    source = Path(path)
    mmap = mmap and zipfile.is_zipfile(source)
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = refused_globals(err)
        if refused:
            raise CheckpointError(
                f"{str(source)!r} holds objects that weights_only=True refuses to unpickle: "
                f"{', '.join(refused)}. Unpickling them would run their code. Only if you "
                "trust the checkpoint and where it came from, load it with weights_only=False "
                "(strategy.load_checkpoint(path, weights_only=False), or "
                "consolidate_deepspeed_checkpoint(..., weights_only=False))."
            ) from err
        raise CheckpointError(f"{str(source)!r} is not a readable torch file: {err}") from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(
            f"{str(source)!r} is not a readable torch file (corrupt or truncated?): {err}"
        ) from err


def check_tag_files(tag_directory: Path) -> None:
    """Read every ``*.pt`` file under ``tag_directory`` as `load_deepspeed_file` does.

    The tensors are memory-mapped, not read, so this costs little beside the load itself.

    Raises:
        CheckpointError: a file holds objects beyond tensors, containers and
            `deepspeed_safe_globals`, or is unreadable.
    """
    for file in sorted(tag_directory.rglob("*.pt")):
        load_deepspeed_file(file, mmap=True)


class _SafeLoads:
    """A DeepSpeed checkpoint engine whose ``load`` is `load_deepspeed_file`.

    Everything else (saving, commit, makedirs) is the wrapped engine's.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def safe_engine_loads(engine: Any) -> Iterator[None]:
    """While inside, ``engine`` reads checkpoint files with `load_deepspeed_file`.

    Raises:
        CheckpointError: the engine's config loads universal checkpoints, which DeepSpeed
            reads with its own ``torch.load`` calls.
    """
    if engine.load_universal_checkpoint():
        raise CheckpointError(
            "The DeepSpeed config loads universal checkpoints (checkpoint.load_universal), "
            "which DeepSpeed reads with pickle, so a crafted file would run code. Only if "
            "you trust the checkpoint, load it with weights_only=False."
        )
    original = engine.checkpoint_engine
    engine.checkpoint_engine = _SafeLoads(original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


def read_latest(directory: Path) -> str | None:
    """The tag a checkpoint directory's ``latest`` file names, or None without one."""
    try:
        return (directory / "latest").read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def consolidate(directory: Path, tag: str) -> dict[str, Any]:
    """The tag's full fp32 weights, merged from every rank's shards, under plain names
    (`accord.checkpoint.compiled_names.plain_names`)."""
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
