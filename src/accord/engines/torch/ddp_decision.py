"""The step decision carried by `DDPStrategy`'s gradient reduction.

When DDP reduces every parameter's gradient each step, the loop's per-step decision (stop,
skip; a few bits per rank) needs no collective of its own: the wrapped `StepModule` gets
one more parameter with one slot per rank, always zero, and the loss gets a term whose
gradient is a rank's bits in its own slot. DDP averages that gradient with the others, so
after backward every rank reads every rank's bits from it (`DecisionSlots.read`).
"""

from __future__ import annotations

import torch
from torch import nn

from accord.core.step_module import StepModule

__all__ = ["DECISION_PARAMETER", "DecisionSlots", "add_decision_slots"]

DECISION_PARAMETER = "accord_step_decision"
"""The parameter of the wrapped `StepModule` whose gradient carries the step decision."""


def add_decision_slots(step_module: StepModule, world_size: int, device: torch.device) -> None:
    """Register `DECISION_PARAMETER` on ``step_module``: one zero slot per rank, on
    ``device``.

    DDP buckets gradients per dtype: slots of the parameters' dtype share their bucket
    instead of costing an all-reduce of their own.
    """
    dtype = _slot_dtype(step_module.module, world_size)
    slots = torch.zeros(world_size, dtype=dtype, device=device)
    step_module.register_parameter(DECISION_PARAMETER, nn.Parameter(slots))


def _slot_dtype(module: nn.Module, world_size: int) -> torch.dtype:
    """The dtype of ``module``'s first trainable floating-point parameter (float32 if it has
    none): it holds a rank's bits (at most 15) over the world size closely enough to round
    back, except float16 beyond 4096 ranks, where the quotient leaves its normal range."""
    for param in module.parameters():
        if param.requires_grad and param.is_floating_point():
            if param.dtype == torch.float16 and world_size > 4096:
                break
            return param.dtype
    return torch.float32


class DecisionSlots:
    """The parameter whose averaged gradient carries the step decision (one slot per rank)
    of the DDP module ``owner``, with the weights that put a rank's bits in its own slot:
    the loop's term is ``dot(param, weights(bits))``, one autograd node."""

    __slots__ = ("by_bits", "owner", "param", "rank")

    def __init__(self, owner: nn.Module, param: nn.Parameter, rank: int) -> None:
        self.owner = owner
        self.param = param
        self.rank = rank
        # Per value of integer bits (at most 8 values): built once, never written to.
        self.by_bits: dict[int, torch.Tensor] = {}

    def weights(self, bits: int | torch.Tensor) -> torch.Tensor:
        """A constant vector: ``bits`` at this rank's slot, zero elsewhere."""
        if not isinstance(bits, int):
            return self.weights(1) * bits.to(self.param.dtype)
        weights = self.by_bits.get(bits)
        if weights is None:
            weights = torch.zeros_like(self.param, requires_grad=False)
            weights[self.rank] = bits
            self.by_bits[bits] = weights
        return weights

    def read(self) -> list[int]:
        """Every rank's bits from the averaged gradient; the slots are zero again after."""
        grad = self.param.grad
        if grad is None:
            raise RuntimeError("read_step_decision before a backward of step_decision_term.")
        values = grad.tolist()
        world_size = len(values)
        if not any(values):
            return [0] * world_size  # nearly every step: nothing to clear
        grad.zero_()
        # DDP averaged the slots: each holds one rank's bits over the world size.
        return [round(v * world_size) for v in values]
