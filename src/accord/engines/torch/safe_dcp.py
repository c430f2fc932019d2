"""Reading torch.distributed.checkpoint directories without running code from them.

torch's `FileSystemReader` unpickles a checkpoint's ``.metadata`` with plain `pickle`, and
its `DefaultLoadPlanner` loads non-tensor entries with ``torch.load(weights_only=False)``:
a crafted directory runs code on load. `SafeFileSystemReader` unpickles the metadata with an
unpickler that admits only the classes DCP writes there, and `SafeLoadPlanner` loads the
non-tensor entries with ``weights_only=True``. Anything else is refused with a
`CheckpointError` naming the object. `read_whole` reads a directory into whole tensors in
one process, without a model or a process group.
"""

from __future__ import annotations

import io
import itertools
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

from accord.errors import CheckpointError

__all__ = [
    "METADATA_GLOBALS",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "WholeStateLoadPlanner",
    "checkpoint_errors",
    "load_metadata",
    "read_whole",
]

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
"""(module, name) pairs a DCP ``.metadata`` may name besides DCP's own metadata classes and
torch dtypes."""


def _admitted(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    if module == dcp_metadata.__name__:
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) or name == "_MEM_FORMAT_ENCODING"
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, source: str) -> None:
        super().__init__(stream)
        self._source = source

    @override
    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise CheckpointError(
                f"{self._source} names {module}.{name}, which a checkpoint's metadata never "
                "holds; it was refused so that loading runs no code from the file. Load it "
                "with weights_only=False only if you trust who wrote it."
            )
        return super().find_class(module, name)


def load_metadata(data: bytes, source: str) -> Metadata:
    """Unpickle a DCP ``.metadata`` file's ``data``, admitting only DCP's own classes.

    Raises:
        CheckpointError: the data names any other global, or is not a DCP metadata file.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"{source} is not a readable checkpoint metadata file: {err}"
        ) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{source} holds a {type(metadata).__name__}, not a checkpoint's Metadata."
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A `FileSystemReader` whose ``.metadata`` is read by `load_metadata`."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read(), str(path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A `DefaultLoadPlanner` that loads non-tensor entries with ``weights_only=True``."""

    @override
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"The checkpoint entry {read_item.dest_index.fqn!r} holds objects beyond "
                f"tensors and plain containers, refused so that loading runs no code ({err}). "
                "Load it with weights_only=False only if you trust who wrote it."
            ) from err
        # Placed as torch's own load_bytes places what it unpickles (once, without the
        # weights-only unpickler): at its path in the caller's dict when it was flattened.
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class WholeStateLoadPlanner(SafeLoadPlanner):
    """Loads everything a checkpoint holds as whole tensors, into an empty dict.

    The target is built from the checkpoint's metadata (every entry at its global size),
    so no model is needed; DCP assembles each tensor from the shards every rank wrote.
    With ``safe=False`` non-tensor entries are read as torch's own planner reads them.
    """

    def __init__(self, *, safe: bool = True) -> None:
        super().__init__()
        self._safe = safe
        self.loaded: dict[str, Any] = {}
        """What the checkpoint holds, nested as saved (filled in place during the load)."""

    @override
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if state_dict or metadata is None:
            raise ValueError("WholeStateLoadPlanner fills an empty dict from the metadata.")
        paths = metadata.planner_data or {}
        for key, entry in metadata.state_dict_metadata.items():
            value: Any = entry
            if isinstance(entry, TensorStorageMetadata):
                value = torch.empty(entry.size, dtype=entry.properties.dtype)
            _set_path(state_dict, tuple(paths.get(key, (key,))), value)
        # DCP's load copies back only keys the caller's dict had, and it had none.
        self.loaded = state_dict
        super().set_up_planner(state_dict, metadata, is_coordinator)

    @override
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self._safe:
            super().load_bytes(read_item, value)
        else:
            DefaultLoadPlanner.load_bytes(self, read_item, value)


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (keys, or list indices) under ``root``, making containers."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        child: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            node[key] = node[key] if node[key] is not None else child
            node = node[key]
        else:
            node = node.setdefault(key, child)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def read_whole(path: str, *, weights_only: bool = True) -> dict[str, Any]:
    """Every entry of the DCP checkpoint at ``path``, nested as saved, tensors whole.

    Reads in this process only (no process group needed or used). With ``weights_only``
    (the default) nothing in the directory can run code.

    Raises:
        CheckpointError: the metadata or an entry holds objects beyond tensors and plain
            containers (with ``weights_only``), or is not readable.
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = SafeFileSystemReader(path) if weights_only else FileSystemReader(path)
    planner = WholeStateLoadPlanner(safe=weights_only)
    with warnings.catch_warnings(), checkpoint_errors("read", path):
        # Reading in one process is the intent here, not a fallback to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner.loaded


@contextmanager
def checkpoint_errors(action: str, path: object) -> Iterator[None]:
    """DCP's ``CheckpointException`` inside the block as accord's `CheckpointError`.

    DCP wraps what a rank raised while reading or writing in a ``CheckpointException``,
    which derives from ``BaseException``, so ``except Exception`` (and ``except
    CheckpointError``) would not see it. A rank's own `CheckpointError` (a refused object,
    an unreadable entry) is raised as it is; anything else becomes a `CheckpointError`
    naming ``action`` (``"read"``, ``"write"``), ``path`` and the first rank's error.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = [failure[0] for failure in err.failures.values()]
        own = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if own is not None:
            raise own from err
        first: BaseException = failures[0] if failures else err
        raise CheckpointError(
            f"Could not {action} the sharded checkpoint at {path}: {type(first).__name__}: {first}"
        ) from err
