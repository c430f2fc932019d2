"""ZeRO-3 specifics: every parameter is partitioned across the ranks, empty on each one.

Reading or writing full weights therefore gathers them first, with DeepSpeed's
``zero.GatheredParameters`` (the engine's own ZeRO traffic, on the process group the
strategy's collective created or joined). Every rank must call these functions together.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from accord.engines.deepspeed.checkpoint_directory import strip_step_prefix
from accord.imports import import_optional

__all__ = ["full_state_dict", "load_full_state_dict", "materialize_parameters"]


def full_state_dict(engine: Any) -> dict[str, Any]:
    """The engine's full state dict with the user's names, on global rank 0; ``{}`` elsewhere.

    The parameters are gathered one module at a time, so no rank holds the whole model
    twice.
    """
    state = engine._zero3_consolidated_16bit_state_dict()
    return {} if state is None else strip_step_prefix(state)


def load_full_state_dict(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a full state dict into the partitioned ``module``; rank 0's copy is kept."""
    deepspeed = import_optional("deepspeed", "DeepSpeedStrategy")
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        module.load_state_dict(state, strict=strict)


def materialize_parameters(module: nn.Module) -> None:
    """Replace the partitioned parameters with plain full ones.

    Tied parameters stay tied: each partitioned parameter becomes one new parameter.
    """
    deepspeed = import_optional("deepspeed", "DeepSpeedStrategy")
    replaced: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        own = list(submodule.named_parameters(recurse=False, remove_duplicate=False))
        pending = list({id(p): p for _, p in own if id(p) not in replaced}.values())
        if pending:
            with deepspeed.zero.GatheredParameters(pending, modifier_rank=None):
                for param in pending:
                    replaced[id(param)] = nn.Parameter(
                        param.data.detach().clone(), requires_grad=param.requires_grad
                    )
        for name, param in own:
            setattr(submodule, name, replaced[id(param)])
