"""Tensor plumbing shared by collectives and strategies.

``out=`` checks and the buffers an op writes, the byte view of a buffer, the uneven
all_gather, moving a nested batch. `Collective`
keeps its promises (inputs never modified, results on the input's device or in the caller's
``out=``, integer means as floats) with these helpers, written once for every op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from accord.core.reduce_op import ReduceOp

__all__ = [
    "all_gather_uneven",
    "byte_view",
    "check_out",
    "deliver",
    "finish",
    "move_to_device",
    "output_buffer",
    "same_memory",
    "work_buffer",
]


def check_out(out: torch.Tensor, shape: Any, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an ``out=`` tensor whose shape, dtype or device differs from the result's."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out= must be a torch.Tensor, got {type(out).__name__}.")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out= must have shape {tuple(shape)}, dtype {dtype} and device {device}; "
            f"got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}."
        )


def output_buffer(
    tensor: torch.Tensor,
    shape: Any,
    out: torch.Tensor | None,
    dtype: torch.dtype | None = None,
    result_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The contiguous buffer of ``dtype`` (default: ``tensor``'s) on ``tensor``'s device that
    a primitive fills with a result of ``shape`` and ``result_dtype`` (default: ``dtype``):
    ``out`` itself where it is contiguous and of ``dtype`` (checked first), else a new one,
    which `deliver` (or `finish`) copies into ``out``."""
    dtype = tensor.dtype if dtype is None else dtype
    if out is not None:
        check_out(out, shape, dtype if result_dtype is None else result_dtype, tensor.device)
        if out.is_contiguous() and out.dtype == dtype:
            return out
    return tensor.new_empty(shape, dtype=dtype)


def deliver(buffer: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An op's result from the `output_buffer` it filled: ``out`` (filled from ``buffer``
    where the two differ), or ``buffer`` itself without one."""
    if out is not None and buffer is not out:
        return out.copy_(buffer)
    return buffer


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the buffer a data-movement op sends: bool as uint8 of the same size.

    Broadcast, gather and the other ops that only copy bytes accept every dtype this way;
    bool is not a gloo type.
    """
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def work_buffer(
    tensor: torch.Tensor,
    shape: Any,
    work_dtype: torch.dtype,
    result_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A contiguous buffer of ``work_dtype`` holding ``tensor``'s values, and the ``out``."""
    if out is tensor and tensor.dtype == work_dtype == result_dtype and out.is_contiguous():
        return out, out  # in place: shape, dtype and device match by construction
    if out is not None:
        check_out(out, shape, result_dtype, tensor.device)
        if out.is_contiguous() and out.dtype == work_dtype:
            if not same_memory(out, tensor) or out.stride() != tensor.stride():
                out.copy_(tensor)
            return out, out
    # One fused allocate-and-copy (cheaper than empty + copy_ for small tensors).
    if tensor.dtype == work_dtype:
        work = tensor.clone(memory_format=torch.contiguous_format)
    else:
        work = tensor.to(work_dtype, memory_format=torch.contiguous_format)
    return work, out


def finish(
    work: torch.Tensor,
    out: torch.Tensor | None,
    result_dtype: torch.dtype,
    op: ReduceOp,
    world_size: int,
) -> torch.Tensor:
    """Turn a reduced work buffer into the result: divide for mean, cast, fill ``out``."""
    if op is ReduceOp.MEAN:
        if work.is_floating_point():
            work.div_(world_size)
        else:
            work = work.to(result_dtype).div_(world_size)
    elif work.dtype != result_dtype:
        work = work.to(result_dtype)
    if out is not None and work is not out:
        return out.copy_(work)
    return work


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same memory.

    Tensors without host-visible storage (XLA's) all report ``data_ptr() == 0``; for them
    only the same tensor object counts as the same memory.
    """
    if a is b:
        return True
    address = a.data_ptr()
    return address != 0 and address == b.data_ptr()


def all_gather_uneven(
    all_gather: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor, *, even: bool
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, first dimensions allowed to differ.

    ``all_gather`` is a collective's (stacking equal shapes). The tensors are padded to the
    longest, gathered and trimmed; a 0-d tensor counts as one element. ``even=True`` skips
    the exchange of lengths when every shape is known to be the same.
    """
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if even:
        gathered = all_gather(tensor)
        return gathered.reshape(-1, *gathered.shape[2:])
    length = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    lengths = all_gather(length).flatten().tolist()
    longest = max(lengths)
    if tensor.shape[0] < longest:
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        tensor = padded
    gathered = all_gather(tensor)
    if all(n == longest for n in lengths):
        return gathered.reshape(-1, *gathered.shape[2:])
    return torch.cat([gathered[rank, :n] for rank, n in enumerate(lengths)])


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a nested batch to ``device``, keeping the container types.

    A batch whose tensors are all on ``device`` already comes back as the same object:
    the training loop calls this once per batch, so the common cases (a tensor, a plain
    list, tuple or dict of tensors) are checked directly, without a generic walk.
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else _to(batch, device)
    kind = type(batch)
    items = batch if kind is list or kind is tuple else batch.values() if kind is dict else None
    if items is not None:
        for item in items:
            if not (isinstance(item, torch.Tensor) and item.device == device):
                break
        else:
            return batch
    return apply_to_collection(batch, torch.Tensor, _to, device)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=device.type == "cuda")
