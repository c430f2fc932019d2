"""Manual optimization behind `Module`: `ManualOptimizer` (what ``Module.optimizers``
returns when ``automatic_optimization`` is False) and the bodies of ``Module``'s
manual-optimization helpers: ``optimizers``, ``wrapped_module``, ``lr_schedulers``,
``clip_gradients``, ``toggle_optimizer`` and ``untoggle_optimizer``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module

__all__ = ["ManualOptimizer"]


class ManualOptimizer:
    """An optimizer as `Module.optimizers` returns it under manual optimization.

    ``step()`` goes through the strategy (the precision's loss scaler included), calls
    ``on_before_optimizer_step`` and counts one ``global_step``; ``zero_grad()`` goes
    through the strategy too. Everything else (``param_groups``, ``state_dict()``, ...)
    is the wrapped optimizer's.

    Args:
        optimizer: the optimizer the strategy set up.
        module: the module being trained.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: Module) -> None:
        self.optimizer = optimizer
        self._module = module
        self.clipped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def step(self, closure: Any = None) -> None:
        """Apply the step (``closure``, if given, is called first, as Lightning does)."""
        if closure is not None:
            closure()
        trainer = self._module.trainer
        strategy = trainer.strategy
        if not self.clipped:
            # So on_before_optimizer_step sees the true gradients under a loss scaler.
            strategy.unscale_gradients(self.optimizer)
        self.clipped = False
        self._module.on_before_optimizer_step(self.optimizer)
        strategy.optimizer_step(self.optimizer, self._module.wrapped_module)
        trainer.global_step += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this optimizer's parameters."""
        self._module.trainer.strategy.zero_grad(self.optimizer, self._module.wrapped_module)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """Inside it, only this optimizer's parameters require gradients
        (`Module.toggle_optimizer`); with ``sync_grad=False`` a backward inside it also
        skips the strategy's gradient synchronisation (DDP's all-reduce), as Lightning's
        ``LightningOptimizer.toggle_model`` does.

        For gradient accumulation by hand: on the batches that do not step, run the
        backward under ``sync_grad=False``; the gradients add up on each rank, and the
        synchronised backward of the stepping batch averages the sum over the ranks.
        """
        module = self._module
        strategy = module.trainer.strategy
        with strategy.no_backward_sync(module.wrapped_module, enabled=not sync_grad):
            module.toggle_optimizer(self)
            try:
                yield
            finally:
                module.untoggle_optimizer(self)


def clip_gradients_of(
    module: Module, optimizer: ManualOptimizer | torch.optim.Optimizer, gradient_clip_val: float
) -> None:
    """``Module.clip_gradients``: clip ``optimizer``'s parameters' gradients through the
    strategy, and mark a `ManualOptimizer` as clipped (its step then does not unscale)."""
    inner = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
    params = nn.ParameterList(p for group in inner.param_groups for p in group["params"])
    module.trainer.strategy.clip_gradients(params, inner, gradient_clip_val)
    if isinstance(optimizer, ManualOptimizer):
        optimizer.clipped = True


def freeze_others(module: Module, optimizer: ManualOptimizer | torch.optim.Optimizer) -> None:
    """``Module.toggle_optimizer``: set ``requires_grad=False`` on the fit's other
    optimizers' parameters, remembering each one's flag in ``module._toggled``."""
    inner = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
    mine = {id(p) for group in inner.param_groups for p in group["params"]}
    for other in module.trainer.optimizers:
        for group in other.param_groups:
            for param in group["params"]:
                if id(param) not in mine and param not in module._toggled:
                    module._toggled[param] = param.requires_grad
                    param.requires_grad = False


def restore_requires_grad(module: Module) -> None:
    """``Module.untoggle_optimizer``: give every parameter `freeze_others` froze its
    ``requires_grad`` back."""
    for param, requires_grad in module._toggled.items():
        param.requires_grad = requires_grad
    module._toggled = {}


def wrapped_module_of(module: Module) -> nn.Module:
    """``Module.wrapped_module``: the module as the strategy wrapped it.

    Raises:
        ConfigurationError: outside a run.
    """
    wrapped = module.trainer.model_wrapper
    if wrapped is None:
        raise ConfigurationError(
            f"{type(module).__name__} is not in a run; manual optimization works inside "
            "training_step."
        )
    return wrapped


def schedulers_of(module: Module) -> Any:
    """``Module.lr_schedulers``: the fit's LR schedulers: one, a list, or None."""
    schedulers = [c.scheduler for c in module.trainer.lr_scheduler_configs]
    if not schedulers:
        return None
    return schedulers[0] if len(schedulers) == 1 else schedulers


def optimizers_of(module: Module) -> ManualOptimizer | list[ManualOptimizer]:
    """``Module.optimizers``: the fit's optimizers (one, or a list), each wrapped in a
    `ManualOptimizer`."""
    wrapped = [ManualOptimizer(o, module) for o in module.trainer.optimizers]
    return wrapped[0] if len(wrapped) == 1 else wrapped
