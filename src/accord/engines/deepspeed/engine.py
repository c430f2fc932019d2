"""Starting a DeepSpeed engine on the process group the strategy's collective provides.

DeepSpeed's communication module wraps torch.distributed's default process group, and the
engine's own ZeRO traffic (gradient reduce-scatters, parameter all-gathers) runs there. The
strategy's collective creates or joins that group in ``setup``; `initialize_engine` builds
the engine on it and never creates one itself.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from accord.errors import ConfigurationError
from accord.imports import import_optional

__all__ = ["initialize_engine", "require_process_group"]


def require_process_group(collective_name: str) -> None:
    """Check that a default torch.distributed process group exists (a query, no traffic).

    Raises:
        ConfigurationError: the collective named ``collective_name`` made or joined none.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            "DeepSpeed runs on a torch.distributed process group, but "
            f"{collective_name} did not create or join one. Use "
            "DeepSpeedCollective or a collective built on TorchCollective."
        )


def initialize_engine(
    model: nn.Module, config: dict[str, Any], optimizer: torch.optim.Optimizer | None
) -> Any:
    """``deepspeed.initialize`` for ``model``: the engine, on the existing process group.

    With ``optimizer`` the engine trains: it steps ``optimizer``, or, when ``config`` names
    an optimizer, one DeepSpeed builds from the model's trainable parameters. Without, it
    only evaluates. ``config`` is copied, since DeepSpeed edits the dict it is given.

    Raises:
        MissingDependencyError: deepspeed is not installed.
    """
    deepspeed = import_optional("deepspeed", "DeepSpeedStrategy")
    kwargs: dict[str, Any] = {}
    if optimizer is not None and "optimizer" in config:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    elif optimizer is not None:
        kwargs["optimizer"] = optimizer
    engine, *_ = deepspeed.initialize(
        model=model, config=copy.deepcopy(config), dist_init_required=False, **kwargs
    )
    return engine
