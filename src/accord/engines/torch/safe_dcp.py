"""Reading torch.distributed.checkpoint directories without running code from them.

torch's `FileSystemReader` unpickles a checkpoint's ``.metadata`` with plain `pickle`, and
its `DefaultLoadPlanner` loads non-tensor entries with ``torch.load(weights_only=False)``:
a crafted directory runs code on load. `SafeFileSystemReader` unpickles the metadata with an
unpickler that admits only the classes DCP writes there, and `SafeLoadPlanner` loads the
non-tensor entries with ``weights_only=True``. Anything else is refused with a
`CheckpointError` naming the object.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

from accord.errors import CheckpointError

__all__ = ["METADATA_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "load_metadata"]

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
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"The checkpoint entry {read_item.dest_index.fqn!r} holds objects beyond "
                f"tensors and plain containers, refused so that loading runs no code ({err}). "
                "Load it with weights_only=False only if you trust who wrote it."
            ) from err
        # The weights-only unpickler admitted every global the entry names, so torch's own
        # loader (which also places entries of a flattened state dict) runs nothing else.
        value.seek(0)
        super().load_bytes(read_item, value)
