"""The optimizer step both kinds of optimization share, and what a step's closure is.

`apply_step` is what `accord.module_optimization.StrategyOptimizer.step` does in a fit:
the closure (the batch's forward and backward, when the loop gives one), then, if the
accumulation window ran a backward, unscaling, the ``on_before_optimizer_step`` hooks,
clipping and the strategy's step. `backward_with_hooks` is ``manual_backward``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from accord.errors import ConfigurationError
from accord.module_optimization import StepFunction, StrategyOptimizer

if TYPE_CHECKING:
    from accord.trainer.automatic_step import AutomaticStep
    from accord.trainer.trainer import Trainer

__all__ = ["Closure", "apply_step", "backward_with_hooks", "before_step", "clip", "needs_closure"]


def backward_with_hooks(trainer: Trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """``manual_backward``: the ``on_before_backward`` hooks, the strategy's backward (the
    module's own ``backward`` inside it where it overrides it), ``on_after_backward``."""
    state = trainer._state
    hooks, wrapped = state.hooks, state.wrapped
    if hooks is None or wrapped is None:
        raise ConfigurationError("manual_backward() works inside training_step during fit().")
    for hook in hooks.event("on_before_backward"):
        hook(loss)
    own = hooks.module_hook("backward")
    backward_fn = None if own is None else (lambda scaled: own(scaled, *args, **kwargs))
    if backward_fn is None and (args or kwargs):
        backward_fn = lambda scaled: scaled.backward(*args, **kwargs)  # noqa: E731
    trainer.strategy.backward(loss, wrapped, backward_fn)
    for hook in hooks.event("on_after_backward"):
        hook()


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (``torch.optim.LBFGS``)."""
    parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def apply_step(trainer: Trainer) -> StepFunction:
    """What `StrategyOptimizer.step` does in this Trainer's fit: run the closure, then (if
    the window ran a backward) ``on_before_optimizer_step``, clipping and the strategy's
    step; under manual optimization each step also counts one ``global_step``."""

    def step(optimizer: StrategyOptimizer, closure: Callable[[], Any] | None) -> Any:
        state = trainer._state
        model, wrapped = state.module, state.wrapped
        assert model is not None and wrapped is not None
        automatic = model.automatic_optimization
        if closure is not None and needs_closure(optimizer.optimizer):

            def full() -> Any:
                loss = closure()
                before_step(trainer, optimizer, automatic)
                return loss

            trainer.strategy.optimizer_step(optimizer.optimizer, wrapped, full)
            return None
        result = closure() if closure is not None else None
        loop = state.fit_loop
        if automatic and loop is not None and not loop.window_has_backward:
            return result
        before_step(trainer, optimizer, automatic)
        trainer.strategy.optimizer_step(optimizer.optimizer, wrapped)
        if not automatic:
            optimizer.clipped = False
            trainer.global_step += 1
        return result

    return step


def before_step(trainer: Trainer, optimizer: StrategyOptimizer, automatic: bool) -> None:
    """Right before ``optimizer`` steps: unscale (a loss scaler's), the
    ``on_before_optimizer_step`` hooks, and (automatic optimization) the clipping."""
    hooks = trainer._state.hooks
    assert hooks is not None
    inner = optimizer.optimizer
    trainer.strategy.unscale_gradients(inner)
    for hook in hooks.event("on_before_optimizer_step"):
        hook(inner)
    if automatic:
        clip(trainer, hooks.module_hook("configure_gradient_clipping"), inner)


def clip(
    trainer: Trainer, own: Callable[..., Any] | None, optimizer: torch.optim.Optimizer
) -> None:
    """The module's ``configure_gradient_clipping`` where it overrides it, else the clipping
    ``gradient_clip_val``/``gradient_clip_algorithm`` ask for."""
    if own is not None:
        own(
            optimizer,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        )
        return
    wrapped = trainer._state.wrapped
    assert wrapped is not None
    if trainer.gradient_clip_val is None:
        return
    value = float(trainer.gradient_clip_val)
    if trainer.gradient_clip_algorithm == "value":
        trainer.strategy.clip_gradients_value(wrapped, optimizer, value)
    else:
        trainer.strategy.clip_gradients(wrapped, optimizer, value)


class Closure:
    """The batch's forward and backward, as the closure an ``optimizer_step`` override
    gets: each call runs them again (an optimizer such as LBFGS calls it several times)."""

    def __init__(self, epoch: AutomaticStep, batch: Any, batch_idx: int) -> None:
        self.epoch, self.batch, self.batch_idx = epoch, batch, batch_idx
        self.output: Any = None
        self.ran = False

    def __call__(self) -> torch.Tensor | None:
        self.output = self.epoch.forward_backward(self.batch, self.batch_idx)
        self.ran = True
        loss: torch.Tensor | None = self.epoch.state.last_loss
        return loss
