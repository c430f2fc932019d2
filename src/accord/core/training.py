"""The training half of `Strategy`: what the loop asks of it on every batch.

Moving a batch to the device, running a step hook through the strategy's wrapper, backward,
clipping, the optimizer step, zeroing, and the per-batch decision that can ride in the
gradient reduction. Engines override what their wrapper or engine does differently; the
loop resolves `batch_mover` and `step_function` once per epoch, so a strategy that keeps
the defaults costs no call of its own per batch for them.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accord.core.buffers import move_to_device
from accord.core.run_settings import RunSettings
from accord.precision import Precision

__all__ = ["StrategyTraining"]

# Returned where a context has nothing to do; a nullcontext can be entered again and again.
_NO_CONTEXT = contextlib.nullcontext()


class StrategyTraining(ABC):
    """The per-batch training operations every `Strategy` has; see `Strategy`."""

    precision: Precision
    run_settings: RunSettings

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in ``batch`` (nested lists, tuples, dicts) to `root_device`.

        In a true-precision mode (``bf16-true``, ``16-true``) its floating-point tensors
        also take the module's dtype (`Precision.convert_input`); in the other modes that
        returns the batch at once, so the step pays nothing for it.
        """
        # Move first, then cast: a pinned CPU batch is copied asynchronously and the cast
        # runs on the device, instead of a synchronous copy of a fresh unpinned CPU tensor.
        return self.precision.convert_input(move_to_device(batch, self.root_device))

    def batch_mover(self) -> Callable[[Any], Any]:
        """What the loop calls on each batch: `batch_to_device`, or, where it would only
        move tensors (no dtype to cast to, not overridden), `move_to_device` to
        `root_device` directly. Resolved once per epoch."""
        if type(self).batch_to_device is StrategyTraining.batch_to_device and (
            self.precision.input_dtype is None
        ):
            return functools.partial(move_to_device, device=self.root_device)
        return self.batch_to_device

    def on_train_batch_start(self, batch_idx: int, last: bool, window_ends: bool = True) -> None:
        """The Trainer starts training batch ``batch_idx``; ``last``: the epoch's last one;
        ``window_ends``: its backward ends an accumulation window (an optimizer step
        follows). Engines that count the window themselves (DeepSpeed, Horovod) note it."""

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context for forward passes (autocast for mixed precision)."""
        return self.precision.forward_context()

    def step_function(self, model: nn.Module, name: str) -> Callable[..., Any]:
        """`step` with ``model`` and ``name`` bound, resolved once per epoch: the user's
        method itself where this strategy's `step` is the default."""
        if type(self).step is StrategyTraining.step:
            method: Callable[..., Any] = getattr(self.unwrap(model), name)
            return method
        return functools.partial(self.step, model, name)

    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        """Run the user's step hook ``name`` (``"training_step"``, ...) through ``model``.

        Strategies whose wrapper must see the call (DDP, DP) route it through the
        wrapper's ``forward``; the default calls the hook on the unwrapped module.
        """
        return getattr(self.unwrap(model), name)(*args)

    def backward(
        self,
        loss: torch.Tensor,
        module: nn.Module,
        backward_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Backpropagate ``loss``; ``backward_fn`` (a module's ``backward`` override) runs
        the backward of the loss as the precision scaled it."""
        self.precision.backward(loss, backward_fn)

    def carries_step_decision(self, module: nn.Module) -> bool:
        """Whether the gradient synchronisation of ``module``'s backward carries the loop's
        per-batch decision (a skipped batch, a non-finite loss, a preemption signal).

        Where True, every backward the training loop runs goes through
        `step_decision_term`, and with one batch per optimizer step the loop reads the
        decision after backward (`read_step_decision`) instead of agreeing through the
        collective first: a rank whose ``training_step`` returned None backpropagates the
        term alone, and a batch some rank skipped has its gradients dropped on every rank.
        The default, False: the ranks agree through the collective before backward.
        """
        return False

    def step_decision_term(
        self, module: nn.Module, bits: int | torch.Tensor, loss: torch.Tensor | None
    ) -> torch.Tensor:
        """What the loop backpropagates where `carries_step_decision`: ``loss`` (or, for a
        skipped batch, zero through every trainable parameter) plus a zero-valued term
        whose gradient is this rank's ``bits``."""
        raise NotImplementedError(f"{type(self).__name__} does not carry the step decision.")

    def read_step_decision(self, module: nn.Module) -> list[int]:
        """After the synchronised backward: every rank's bits, by rank (and clear them)."""
        raise NotImplementedError(f"{type(self).__name__} does not carry the step decision.")

    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation while ``enabled`` (between accumulation steps).

        Under manual optimization the forward and the backward both run inside
        ``training_step``; there the context may be entered around the backward alone
        (`StrategyOptimizer.toggle_model` with ``sync_grad=False``).
        """
        return _NO_CONTEXT

    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Clip the gradients of ``module`` to total norm ``max_norm``; return the norm."""
        self._finish_gradients(optimizer)
        self.precision.unscale_gradients(optimizer)
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def clip_gradients_value(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_value: float
    ) -> None:
        """Clamp each gradient element of ``module`` to ``[-clip_value, clip_value]``
        (``gradient_clip_algorithm="value"``)."""
        self._finish_gradients(optimizer)
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_value)

    def _finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s gradients final before `clip_gradients` or
        `clip_gradients_value` reads them (a strategy that reduces them in the background
        waits for that here); the default has nothing to do."""

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        closure: Callable[[], Any] | None = None,
    ) -> None:
        """Apply one optimizer step. ``closure`` is given only for an optimizer whose
        ``step`` needs one (``torch.optim.LBFGS``), which calls it as often as it needs."""
        self.precision.optimizer_step(optimizer, closure)

    def refused_module_hooks(self) -> dict[str, str]:
        """The `Module` hooks this strategy cannot honour when a module overrides them,
        each with the reason; the Trainer refuses such a module when a run starts."""
        return {}

    def evaluation_context(self, inference_mode: bool) -> contextlib.AbstractContextManager[Any]:
        """The autograd context evaluation runs in: `torch.inference_mode` when asked for,
        else `torch.no_grad`. Strategies whose backend cannot run in inference mode
        (gloo's collectives, FSDP, XLA) return `torch.no_grad` always."""
        return torch.inference_mode() if inference_mode else torch.no_grad()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide a loss scaler's factor out of ``optimizer``'s gradients (if one is used)."""
        self.precision.unscale_gradients(optimizer)

    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """Clear the gradients after a step."""
        optimizer.zero_grad(set_to_none=True)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper `setup_module` added."""
        return module
