"""`SingleDeviceCollective`: a group of one, with the same return contract as any other."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, ReduceOp

__all__ = ["SingleDeviceCollective"]


class SingleDeviceCollective(Collective):
    """The collective of a single process: every op is the identity on a world of one.

    Results are still new tensors (or ``out=``) so code written for many ranks behaves
    the same on one. ``send``/``recv`` are not available: there is no other rank.
    """

    backend_name = "single device"

    def __init__(self) -> None:
        self._ready = False

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def is_setup(self) -> bool:
        return self._ready

    @override
    def setup(self, **kwargs: Any) -> Self:
        self._ready = True
        return self

    @override
    def teardown(self) -> Self:
        self._ready = False
        return self

    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        pass

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        pass

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        output[0].copy_(tensor)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        output.copy_(tensor)

    @override
    def _barrier(self) -> None:
        pass

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        if output is not None:
            output[0].copy_(tensor)

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        if tensor is not None:
            output.copy_(tensor[0])

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        output.copy_(tensor)
