"""The checkpoint half of `Strategy`: state dicts out and in, checkpoint files written and read.

A strategy that shards (FSDP, DeepSpeed) overrides these; the defaults suit a strategy whose
every rank holds the whole model: rank 0 writes one file atomically and the others wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accord.checkpoint_io import load_checkpoint_file, save_checkpoint_file
from accord.precision import Precision

__all__ = ["StrategyCheckpointing"]


class StrategyCheckpointing(ABC):
    """Checkpoint methods every `Strategy` has; see `Strategy` for the rest."""

    precision: Precision

    @property
    @abstractmethod
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""

    @abstractmethod
    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper the strategy added."""

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank arrives."""

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict of the user's module."""
        return self.unwrap(module).state_dict()

    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        """Load ``state`` into the user's module."""
        self.unwrap(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what `optimizer_state_dict` returned into ``optimizer``."""
        optimizer.load_state_dict(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write ``checkpoint`` atomically from rank 0; every rank waits until it exists."""
        if self.is_global_zero:
            save_checkpoint_file(checkpoint, path)
        self.barrier("save_checkpoint")

    def precision_state_dict(self) -> dict[str, Any]:
        """The precision's state for a checkpoint (a loss scaler's scale, or nothing)."""
        return self.precision.state_dict()

    def load_precision_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `precision_state_dict` returned."""
        self.precision.load_state_dict(state)

    def load_checkpoint(self, path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
        """Read a checkpoint written by `save_checkpoint` (``weights_only`` as `torch.load`)."""
        return load_checkpoint_file(path, weights_only=weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint this strategy wrote (rank 0 only)."""
        if self.is_global_zero:
            Path(path).unlink(missing_ok=True)
