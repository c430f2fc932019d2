"""torch.distributed's side of `TorchCollective`'s names: the backend used when none is
given, which backends average by themselves, and torch's reduce op for each `ReduceOp`.

torch.distributed is imported when one of them is first asked for, not when this module is.
"""

from __future__ import annotations

from typing import Any

import torch

from accord.core.reduce_op import ReduceOp

__all__ = ["averages_natively", "default_torch_backend", "torch_op"]


def default_torch_backend(device: torch.device | None = None) -> str:
    """``nccl`` for CUDA devices when it is available, else ``gloo``."""
    import torch.distributed as dist

    is_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return "nccl" if is_cuda and dist.is_nccl_available() else "gloo"


_TORCH_OPS: dict[ReduceOp, Any] = {}


def averages_natively(backend: str) -> bool:
    """Whether every device backend in ``backend`` (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    implements ``ReduceOp.AVG`` for floating-point tensors (MPI and UCC do not)."""
    return {part.rpartition(":")[2] for part in backend.split(",")} <= {"gloo", "nccl"}


def torch_op(op: ReduceOp) -> Any:
    """torch.distributed's ``ReduceOp`` for ``op`` (``MEAN``: ``AVG``)."""
    if not _TORCH_OPS:  # built on first use: torch.distributed is imported lazily
        import torch.distributed as dist

        _TORCH_OPS.update(
            {
                ReduceOp.SUM: dist.ReduceOp.SUM,
                ReduceOp.MEAN: dist.ReduceOp.AVG,
                ReduceOp.MAX: dist.ReduceOp.MAX,
                ReduceOp.MIN: dist.ReduceOp.MIN,
                ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            }
        )
    return _TORCH_OPS[op]
