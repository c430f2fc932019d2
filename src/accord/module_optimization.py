"""How a `Module` takes part in optimization: `StrategyOptimizer` (the optimizer the hooks
and ``Module.optimizers()`` hand out) and `OptimizationHooks`, the module's optimization
hooks and helpers with Lightning's names.

The hooks whose default does the work (``optimizer_step``, ``optimizer_zero_grad``,
``lr_scheduler_step``, ``configure_gradient_clipping``, ``backward``) are called only
where the module overrides them; otherwise the training loop does the same work directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["OptimizationHooks", "StrategyOptimizer"]

StepFunction = Callable[["StrategyOptimizer", "Callable[[], Any] | None"], Any]


class StrategyOptimizer:
    """An optimizer whose ``step()`` and ``zero_grad()`` go through the strategy.

    The Trainer hands these out: to ``optimizer_step`` (with the batch's closure) and from
    ``Module.optimizers()`` (under manual optimization, where each ``step()`` counts one
    ``global_step``). ``step()`` runs the ``on_before_optimizer_step`` hooks, clipping,
    the precision's loss scaler and the engine's own step; everything else
    (``param_groups``, ``state_dict()``, ...) is the wrapped optimizer's.

    Args:
        optimizer: the optimizer the strategy set up.
        module: the module being trained.
        step: what ``step(closure)`` does: the training loop's step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: Any, step: StepFunction) -> None:
        self.optimizer = optimizer
        self._module = module
        self._step = step
        self.clipped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (the batch's forward and backward, when the Trainer gives one),
        then apply the step."""
        return self._step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this optimizer's parameters, through the strategy."""
        self._module.trainer.strategy.zero_grad(self.optimizer, self._module.wrapped_module)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """Inside it, only this optimizer's parameters require gradients
        (`OptimizationHooks.toggle_optimizer`); with ``sync_grad=False`` a backward inside
        it also skips the strategy's gradient synchronisation (DDP's all-reduce), as
        Lightning's ``LightningOptimizer.toggle_model`` does.

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


def _inner(optimizer: StrategyOptimizer | torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, StrategyOptimizer) else optimizer


class OptimizationHooks:
    """The optimization hooks and helpers of `accord.Module` (Lightning's names)."""

    _toggled: dict[nn.Parameter, bool]

    @property
    def trainer(self) -> Trainer:
        """The Trainer running the module (`Module.trainer`)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- the fit's
    @property
    def wrapped_module(self) -> nn.Module:
        """The module as the strategy wrapped it for the current run.

        Raises:
            ConfigurationError: outside a run.
        """
        wrapped = self.trainer.model_wrapper
        if wrapped is None:
            raise ConfigurationError(
                f"{type(self).__name__} is not in a run; the strategy's wrapper exists "
                "during fit/validate/test/predict."
            )
        return wrapped

    def optimizers(
        self, use_pl_optimizer: bool = True
    ) -> StrategyOptimizer | list[StrategyOptimizer] | torch.optim.Optimizer | Any:
        """The fit's optimizers (one, or a list), as `StrategyOptimizer` objects
        (``use_pl_optimizer=False``: the plain torch optimizers)."""
        trainer = self.trainer
        found: list[Any] = (
            list(trainer._state.step_optimizers) if use_pl_optimizer else trainer.optimizers
        )
        return found[0] if len(found) == 1 else found

    def lr_schedulers(self) -> Any:
        """The fit's LR schedulers: one, a list, or None. Step them yourself under
        manual optimization."""
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    # ------------------------------------------------------------------ backward
    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backpropagate ``loss`` through the strategy (its precision's scaling included),
        with the ``on_before_backward`` and ``on_after_backward`` hooks (callbacks' and
        module's), as the automatic backward does."""
        from accord.trainer.stepping import backward_with_hooks

        backward_with_hooks(self.trainer, loss, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward pass of ``loss`` (already scaled by the precision); override it to
        change how backward runs (the default is ``loss.backward(*args, **kwargs)``)."""
        loss.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    # ---------------------------------------------------------------- the step
    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: StrategyOptimizer,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """Step ``optimizer``; the default is ``optimizer.step(closure=optimizer_closure)``.

        Override it to act around the step (a learning-rate warm-up, a conditional step).
        ``optimizer_closure`` runs the batch's ``training_step`` and backward: an override
        must call it (directly, or by passing it to ``optimizer.step``).
        """
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(
        self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """Clear ``optimizer``'s gradients at the start of an accumulation window (the
        default goes through the strategy)."""
        self.trainer.strategy.zero_grad(_inner(optimizer), self.wrapped_module)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` (with the monitored ``metric``, when it has a ``monitor``)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # ---------------------------------------------------------------- clipping
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients before ``optimizer`` steps; the default clips as the
        Trainer's ``gradient_clip_val``/``gradient_clip_algorithm`` say."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def clip_gradients(
        self,
        optimizer: StrategyOptimizer | torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters through the strategy: to total
        norm ``gradient_clip_val`` (``gradient_clip_algorithm="norm"``, the default) or each
        element to ``[-value, value]`` (``"value"``). None clips nothing."""
        if gradient_clip_val is None:
            return
        algorithm = (gradient_clip_algorithm or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise ConfigurationError(
                f"clip_gradients(gradient_clip_algorithm={gradient_clip_algorithm!r}): use "
                "'norm' or 'value'."
            )
        inner = _inner(optimizer)
        strategy = self.trainer.strategy
        params = nn.ParameterList(p for group in inner.param_groups for p in group["params"])
        if algorithm == "norm":
            strategy.clip_gradients(params, inner, float(gradient_clip_val))
        else:
            strategy.clip_gradients_value(params, inner, float(gradient_clip_val))
        if isinstance(optimizer, StrategyOptimizer):
            optimizer.clipped = True

    # ---------------------------------------------------------------- toggling
    def toggle_optimizer(self, optimizer: StrategyOptimizer | torch.optim.Optimizer) -> None:
        """Let only ``optimizer``'s parameters require gradients (the other optimizers'
        are frozen) until `untoggle_optimizer`; for alternating updates such as a GAN's."""
        mine = {id(p) for group in _inner(optimizer).param_groups for p in group["params"]}
        for other in self.trainer.optimizers:
            for group in other.param_groups:
                for param in group["params"]:
                    if id(param) not in mine and param not in self._toggled:
                        self._toggled[param] = param.requires_grad
                        param.requires_grad = False

    def untoggle_optimizer(self, optimizer: StrategyOptimizer | torch.optim.Optimizer) -> None:
        """Undo `toggle_optimizer`: every parameter requires gradients as before."""
        for param, requires_grad in self._toggled.items():
            param.requires_grad = requires_grad
        self._toggled = {}

    @contextlib.contextmanager
    def toggled_optimizer(
        self, optimizer: StrategyOptimizer | torch.optim.Optimizer
    ) -> Iterator[None]:
        """`toggle_optimizer` for the duration of a ``with`` block."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def freeze(self) -> None:
        """Stop every parameter from requiring gradients and put the module in eval mode."""
        module: Any = self
        for param in module.parameters():
            param.requires_grad = False
        module.eval()

    def unfreeze(self) -> None:
        """Let every parameter require gradients again and put the module in train mode."""
        module: Any = self
        for param in module.parameters():
            param.requires_grad = True
        module.train()
