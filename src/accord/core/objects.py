"""Python objects between ranks: pickled to bytes, moved as uint8 tensors, unpickled.

`Collective.broadcast_object` and `Collective.all_gather_object` run these on the backend's
own primitives, so object traffic needs no numpy and behaves the same on every backend. A
rank whose object cannot be pickled raises `TypeError`; the others learn it from the size
they receive (-1) and raise `CollectiveError` instead of waiting for bytes that never come.
Unpickling runs code chosen by the sender: only the job's own ranks may send.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from accord.errors import CollectiveError

__all__ = [
    "all_gather_object",
    "broadcast_object",
    "bytes_to_tensor",
    "pickle_payload",
    "tensor_to_bytes",
]


def broadcast_object(
    obj: Any,
    src: int,
    rank: int,
    device: torch.device,
    broadcast_: Callable[[torch.Tensor, int], None],
) -> Any:
    """Rank ``src``'s ``obj`` on every rank, sent with ``broadcast_`` (in place, from ``src``)."""
    payload, error = pickle_payload(obj) if rank == src else (b"", None)
    size = torch.tensor([len(payload) if error is None else -1], dtype=torch.int64, device=device)
    broadcast_(size, src)
    length = int(size.item())
    if length < 0:
        if error is not None:
            raise error
        raise CollectiveError(
            f"broadcast_object: rank {src} could not pickle its object; see the TypeError "
            f"raised on rank {src}."
        )
    if rank == src:
        data = bytes_to_tensor(payload, device)
    else:
        data = torch.empty(length, dtype=torch.uint8, device=device)
    if data.numel():
        broadcast_(data, src)
    return pickle.loads(payload if rank == src else tensor_to_bytes(data))


def all_gather_object(
    obj: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    all_gather_into: Callable[[torch.Tensor, torch.Tensor], None],
) -> list[Any]:
    """Every rank's ``obj`` in rank order, gathered with ``all_gather_into`` (sizes, then bytes)."""
    payload, error = pickle_payload(obj)
    size = torch.tensor([len(payload) if error is None else -1], dtype=torch.int64, device=device)
    sizes_tensor = torch.empty((world_size, 1), dtype=torch.int64, device=device)
    all_gather_into(sizes_tensor, size)
    sizes = [int(s) for s in sizes_tensor.flatten().tolist()]
    failed = [r for r, s in enumerate(sizes) if s < 0]
    if failed:
        if error is not None:
            raise error
        raise CollectiveError(
            f"all_gather_object: rank(s) {failed} could not pickle their object; see the "
            "TypeError raised there."
        )
    # Every rank sends a row of the longest length: backends gather equal shapes only.
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(payload)] = bytes_to_tensor(payload, device)
    gathered = torch.empty((world_size, longest), dtype=torch.uint8, device=device)
    if longest:
        all_gather_into(gathered, padded)
    rows = gathered.cpu()
    return [
        obj if r == rank else pickle.loads(tensor_to_bytes(rows[r, :n]))
        for r, n in enumerate(sizes)
    ]


def pickle_payload(obj: Any) -> tuple[bytes, TypeError | None]:
    """``obj`` pickled, or empty bytes and the `TypeError` to raise when it cannot be."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as err:  # pickle raises several types; all mean "not transferable"
        return b"", TypeError(
            f"Cannot send an object of type {type(obj).__name__} between ranks: it is not "
            f"picklable ({err}). Send plain data (tensors, numbers, strings, lists, dicts)."
        )


def bytes_to_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    """``payload`` as a uint8 tensor on ``device``."""
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes a uint8 tensor holds."""
    # clone() gives the bytes their own storage, so a row of a larger tensor pickles alone.
    return bytes(tensor.cpu().clone().untyped_storage())
