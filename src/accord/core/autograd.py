"""Collective ops that carry gradients back, built on any `Collective`.

``all_reduce(sum)`` and ``all_gather`` as autograd functions: each rank's output depends on
every rank's input, so the gradient of a rank's input is the sum, over ranks, of the
gradients their outputs received, which one ``all_reduce(sum)`` in backward gives. Every
rank must run the backward (as it runs the forward), in the same order.
"""

from __future__ import annotations

from typing import Any

import torch

from accord.core.collective import Collective

__all__ = ["all_gather_with_grad", "all_reduce_with_grad"]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, collective: Collective) -> torch.Tensor:
        ctx.collective = collective
        return collective.all_reduce(tensor.detach(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.collective.all_reduce(grad.contiguous(), "sum"), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, collective: Collective) -> torch.Tensor:
        ctx.collective = collective
        return collective.all_gather(tensor.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        collective: Collective = ctx.collective
        summed = collective.all_reduce(grad.contiguous(), "sum")
        return summed[collective.rank], None


def all_reduce_with_grad(collective: Collective, tensor: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``tensor``; its backward sums the gradients the same way."""
    result: torch.Tensor = _AllReduceSum.apply(tensor, collective)  # type: ignore[no-untyped-call]
    return result


def all_gather_with_grad(collective: Collective, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order (``[world_size, *shape]``); each rank's
    input gets the gradient every rank's output gave its slice."""
    result: torch.Tensor = _AllGather.apply(tensor, collective)  # type: ignore[no-untyped-call]
    return result
