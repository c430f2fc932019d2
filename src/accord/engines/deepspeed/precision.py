"""`DeepSpeedPrecision`: the Trainer's precision modes as DeepSpeed config sections.

Under DeepSpeed the engine casts the model and scales the loss, so there is no autocast and
no `torch.amp.GradScaler`; the precision only says which config section to enable and which
dtype the batches are cast to.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from accord.precision import Precision, PrecisionMode

__all__ = ["DeepSpeedPrecision"]

_DTYPES = {
    PrecisionMode.FP16_MIXED: torch.float16,
    PrecisionMode.BF16_MIXED: torch.bfloat16,
    PrecisionMode.BF16_TRUE: torch.bfloat16,
    PrecisionMode.FP16_TRUE: torch.float16,
}


class DeepSpeedPrecision(Precision):
    """The Trainer's precision under DeepSpeed: the engine casts and scales, not torch.amp.

    There is no autocast and no `torch.amp.GradScaler` (DeepSpeed's fp16 mode scales the
    loss itself); `deepspeed_config` gives the config entries for the mode, and
    `convert_input` casts floating-point batch tensors to the dtype the engine gives the
    model.

    Args:
        mode, device: as `Precision`.
    """

    def __init__(self, mode: str | int | PrecisionMode = "32-true", device: Any = "cpu") -> None:
        super().__init__(mode, device)
        self.scaler = None

    @property
    @override
    def input_dtype(self) -> torch.dtype | None:
        """The dtype the engine's model computes in, or None for fp32.

        The engine casts the model in the mixed modes too, so their batches are cast as
        well (`convert_input`, inherited, called from ``Strategy.batch_to_device``).
        """
        return _DTYPES.get(self.mode)

    @property
    def config_key(self) -> str | None:
        """``"fp16"``, ``"bf16"``, or None: the DeepSpeed config section this mode enables."""
        dtype = self.input_dtype
        if dtype is None:
            return None
        return "fp16" if dtype == torch.float16 else "bf16"

    def deepspeed_config(self) -> dict[str, Any]:
        """The config entries that select this precision in DeepSpeed."""
        key = self.config_key
        return {key: {"enabled": True}} if key is not None else {}

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # the engine casts the parameters

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # no autocast: the engine computes in its dtype

    @override
    def __repr__(self) -> str:
        return f"DeepSpeedPrecision({self.mode.value!r})"
