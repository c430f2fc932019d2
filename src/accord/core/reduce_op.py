"""`ReduceOp`: the reductions every collective offers, named once for every backend."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

__all__ = ["OP_SPELLINGS", "ReduceOp", "ReduceOpLike", "reduce_dtypes"]


class ReduceOp(str, Enum):
    """A reduction, named as accord names it on every backend."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, op: ReduceOpLike) -> ReduceOp:
        """Normalise ``op`` (a name, a `ReduceOp`, or a `torch.distributed.ReduceOp`).

        Names are case-insensitive; ``avg`` and ``prod`` are aliases.

        Raises:
            ValueError: ``op`` names no supported reduction.
        """
        if isinstance(op, ReduceOp):
            return op
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if isinstance(name, str):
            key = name.strip().lower()
            parsed = _ALIASES.get(key)
            if parsed is None and key in _BY_VALUE:
                parsed = _BY_VALUE[key]
            if parsed is not None:
                return parsed
        valid = ", ".join(repr(v) for v in [*_BY_VALUE, *_ALIASES])
        raise ValueError(
            f"Unsupported reduce op {op!r}. Use one of {valid} "
            "(case-insensitive), or the matching torch.distributed.ReduceOp."
        )


_BY_VALUE = {member.value: member for member in ReduceOp}
_ALIASES = {"avg": ReduceOp.MEAN, "prod": ReduceOp.PRODUCT}
OP_SPELLINGS: dict[str, ReduceOp] = {**{m: m for m in ReduceOp}, **_BY_VALUE, **_ALIASES}
"""Exact spellings looked up before `ReduceOp.parse` normalises anything else."""

ReduceOpLike = str | ReduceOp | Any
"""Anything `ReduceOp.parse` accepts."""


def reduce_dtypes(dtype: torch.dtype, op: ReduceOp) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype, dtype the backend reduces in) for ``op`` on ``dtype``."""
    if dtype == torch.bool:
        if op is ReduceOp.SUM:
            return torch.int64, torch.int64
        if op is ReduceOp.MEAN:
            return torch.get_default_dtype(), torch.int64
        return torch.bool, torch.uint8
    if op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex):
        return torch.get_default_dtype(), dtype
    return dtype, dtype
