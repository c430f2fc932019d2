"""`StepModule`: routes a wrapper's ``forward`` to the user's step methods.

DDP and DataParallel only synchronise what runs through their ``forward``. Wrapping the
user's module in a `StepModule` lets the Trainer call ``wrapped("training_step", batch,
batch_idx)`` and have the wrapper's hooks fire around the user's ``training_step``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["StepModule"]

_STEPS = frozenset({"training_step", "validation_step", "test_step", "predict_step", "forward"})


class StepModule(nn.Module):
    """``forward(step_name, *args)`` calls ``module.<step_name>(*args)``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the user's ``step_name`` method (one of the step hooks, or ``forward``)."""
        if step_name not in _STEPS:
            raise ValueError(f"StepModule cannot run {step_name!r}; use one of {sorted(_STEPS)}.")
        return getattr(self.module, step_name)(*args, **kwargs)
