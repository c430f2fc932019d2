"""Reading DeepSpeed's checkpoint files without running code from them.

DeepSpeed reads its own files with ``torch.load(weights_only=False)``, so a crafted file
in a checkpoint directory would run its code on load. Here every file is read with
``weights_only=True``, which admits tensors, plain containers and, besides, only the
DeepSpeed classes its files hold (`deepspeed_safe_globals`):

- `check_tag_files` reads every file of a tag on every rank before anything is loaded, so
  a crafted file is refused on all ranks alike, before DeepSpeed's collective load could
  leave some ranks waiting for the others;
- `safe_engine_loads` routes the loads of ``engine.load_checkpoint`` through
  `load_deepspeed_file`.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accord.errors import CheckpointError
from accord.imports import import_optional

__all__ = [
    "check_tag_files",
    "deepspeed_safe_globals",
    "load_deepspeed_file",
    "safe_engine_loads",
]

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""How torch.load's weights-only unpickler names a global it refuses."""


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
        refused = sorted(set(_REFUSED_GLOBAL.findall(str(err))))
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
