"""Which dtypes Horovod's ops carry, and how `HorovodCollective` carries the others.

Horovod reduces ``int32``, ``int64`` and the floating types ``float16``/``float32``/
``float64``, and moves (broadcast, allgather, alltoall) those plus the 8- and 16-bit
integers. Everything else is converted here: narrow integers and bools are reduced as
``int64`` (and cast back, wrapping as the narrow type would), ``bfloat16`` as ``float32``,
complex tensors are summed as pairs of reals, and every dtype is moved as raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from accord.core.reduce_op import ReduceOp

__all__ = ["MOVABLE_DTYPES", "REDUCIBLE_DTYPES", "BFloat16AsFloat32", "movable", "reducible"]

REDUCIBLE_DTYPES = frozenset(
    {torch.int32, torch.int64, torch.float16, torch.float32, torch.float64}
)
"""The dtypes horovod.torch's reductions are registered for (CPU and CUDA alike)."""

MOVABLE_DTYPES = REDUCIBLE_DTYPES | {torch.uint8, torch.int8, torch.int16}
"""The dtypes Horovod's broadcast, allgather and alltoall move as they are."""

Restore = Callable[[torch.Tensor], None]
"""Writes a reduced work tensor back into the tensor it was made from."""


def movable(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of contiguous ``tensor`` in a dtype Horovod moves (its bytes if need be)."""
    flat = tensor.view(-1)
    return flat if flat.dtype in MOVABLE_DTYPES else flat.view(torch.uint8)


def reducible(flat: torch.Tensor, op: ReduceOp) -> tuple[torch.Tensor, Restore]:
    """A copy of ``flat`` in a dtype Horovod reduces, and a function writing a result back.

    Raises:
        TypeError: no reducible dtype holds ``flat``'s values for ``op`` (a complex
            product, max or min; a 64-bit unsigned integer).
    """
    dtype = flat.dtype
    if dtype.is_complex and op is ReduceOp.SUM:
        # A complex sum is the sum of the real and imaginary parts.
        def restore_complex(result: torch.Tensor) -> None:
            flat.copy_(torch.view_as_complex(result))

        return torch.view_as_real(flat).clone(), restore_complex
    if dtype.is_floating_point:
        work = flat.to(torch.float32)  # bfloat16 (and float8 kinds) reduce in float32
    elif not dtype.is_complex and dtype.itemsize <= 4:
        # bool and narrow integers: reduce in int64 and cast back; the truncation wraps
        # around exactly as a reduction in the narrow type would.
        work = flat.to(torch.int64)
    else:
        raise TypeError(
            f"The horovod backend cannot reduce {dtype} tensors with {op.value!r}. Use "
            "int32, int64 or a floating dtype."
        )

    def restore(result: torch.Tensor) -> None:
        flat.copy_(result.to(dtype))

    return work, restore


class BFloat16AsFloat32:
    """A Horovod gradient compression that sends bfloat16 gradients as float32.

    Horovod's reductions have no bfloat16 kernel, so ``bf16-true`` gradients travel as
    float32 and come back as bfloat16; other dtypes pass unchanged.
    `HorovodCollective.distributed_optimizer` uses it when the parameters include bfloat16
    ones and no ``compression`` was given.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        """The tensor to reduce, and the dtype to give the result back in (or None)."""
        if tensor.dtype == torch.bfloat16:
            return tensor.to(torch.float32), torch.bfloat16
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        """Undo `compress`."""
        return tensor if ctx is None else tensor.to(ctx)
