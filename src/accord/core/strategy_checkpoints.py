"""The checkpoint half of `Strategy`: state dicts out and in, checkpoint files written and read.

A strategy that shards (FSDP, DeepSpeed) overrides these; the defaults suit a strategy whose
every rank holds the whole model: rank 0 writes one file atomically and the others wait. The
default load also reads the directories a sharding strategy writes, whole (see
`accord.checkpoint.read_checkpoint`), so any strategy resumes from them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accord.checkpoint.compiled_names import module_names
from accord.checkpoint.reading import read_checkpoint
from accord.checkpoint.writing import save_checkpoint_file
from accord.errors import CheckpointError
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
        """Load ``state`` into the user's module.

        Its names are matched to the module's own, so the plain names of a checkpoint load
        into a module that holds ``torch.compile``'d parts, and back
        (`accord.checkpoint.compiled_names.module_names`).

        Raises:
            CheckpointError: with ``strict``, ``state``'s keys differ from the module's;
                the message names the missing and the unexpected ones.
        """
        target = self.unwrap(module)
        state = module_names(target, state)
        if strict:
            _check_keys(state, target.state_dict())
        target.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what `optimizer_state_dict` returned into ``optimizer``.

        A state keyed by parameter name (as FSDP saves it) is accepted too: the names are
        matched to this optimizer's parameters by their order in its groups.
        """
        optimizer.load_state_dict(_number_parameters(state))

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
        """Read a checkpoint file, or a sharding strategy's directory whole
        (``weights_only`` as `torch.load`)."""
        return read_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint this strategy wrote (rank 0 only)."""
        if self.is_global_zero:
            Path(path).unlink(missing_ok=True)


def _check_keys(state: dict[str, Any], expected: dict[str, Any], limit: int = 10) -> None:
    """Refuse a model state whose keys differ from ``expected``'s, naming the differences.

    Raises:
        CheckpointError: keys are missing from ``state`` or ``state`` has others.
    """
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    if not missing and not unexpected:
        return

    def listed(keys: list[str]) -> str:
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(keys[:limit]) + more

    parts = [f"missing keys: {listed(missing)}"] if missing else []
    parts += [f"unexpected keys: {listed(unexpected)}"] if unexpected else []
    raise CheckpointError(
        f"The checkpoint's model state does not match the model ({'; '.join(parts)}). "
        "Load it into the model it was saved from, or load the weights yourself with "
        "load_state_dict(strict=False)."
    )


def _number_parameters(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name, numbered as ``optimizer.state_dict()``
    numbers parameters (in the order of its groups); a numbered state is returned as is.

    Raises:
        CheckpointError: a parameter has state but is in no group.
    """
    groups = state.get("param_groups", [])
    names = [name for group in groups for name in group.get("params", [])]
    if not names or not all(isinstance(name, str) for name in names):
        return state
    index = {name: number for number, name in enumerate(names)}
    unknown = [name for name in state.get("state", {}) if name not in index]
    if unknown:
        raise CheckpointError(
            f"The checkpoint's optimizer state has entries for parameters in none of its "
            f"groups: {', '.join(map(str, unknown))}."
        )
    return {
        **state,
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }
