"""`XLAStrategyBase`: what both XLA strategies do the same way on a lazy device.

Forward and backward only record a graph; the optimizer step is where it runs. The
gradients are averaged across ranks by the `XLACollective` (``gradient_sync="native"``:
XLA's own bucketed all-reduce) or by ``self.collective.all_reduce`` for each gradient
(``"collective"``, so an injected collective carries them too). Clipping averages the
gradients first and the step that follows does not average them again (the order DDP
gives); evaluation steps are launched after each batch; checkpoints are written from
CPU copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from accord.checkpoint.writing import save_checkpoint_file
from accord.core.collective import Collective
from accord.core.strategy import Strategy, move_to_device
from accord.engines.xla.collective import XLACollective, launch, parameters_with_gradients
from accord.errors import ConfigurationError
from accord.precision import Precision, PrecisionMode

__all__ = ["GradientSync", "XLAStrategyBase"]

GradientSync = Literal["native", "collective"]
"""How the XLA strategies average gradients: XLA's own all-reduce, or the collective's."""

_EVAL_STEPS = frozenset({"validation_step", "test_step", "predict_step"})


class XLAStrategyBase(Strategy):
    """Stepping, clipping, launching and checkpointing on XLA, shared by `XLAStrategy`
    and `SingleDeviceXLAStrategy`.

    Attributes:
        gradient_sync: ``"native"`` or ``"collective"`` (see the module docstring).
    """

    gradient_sync: GradientSync = "native"
    _reduced: set[int]  # ids of the optimizers whose gradients this step has averaged

    @property
    @override
    def needs_own_process(self) -> bool:
        """True: torch_xla's runtime stays in the process that starts it (see `Strategy`)."""
        return True

    @property
    @override
    def compile_refusal(self) -> str | None:
        """XLA traces the step into graphs of its own; a compiled model is not run here."""
        return (
            "XLA traces each step into a graph of its own, and torch.compile's default "
            "backend does not run on XLA devices."
        )

    def _xla_device(self) -> torch.device:
        import torch_xla

        return torch.device(torch_xla.device())

    @override
    def check_precision(self, mode: PrecisionMode, device: torch.device) -> None:
        """Refuse ``16-mixed``: it needs CUDA's gradient scaler, which XLA devices lack.

        Raises:
            ConfigurationError: ``mode`` is ``16-mixed``.
        """
        super().check_precision(mode, device)
        if mode is PrecisionMode.FP16_MIXED:
            raise ConfigurationError(
                "precision='16-mixed' needs CUDA's gradient scaler, which XLA devices do not "
                "have. Use precision='bf16-mixed' or 'bf16-true' on XLA."
            )

    def _precision_on_device(self) -> None:
        self.check_precision(self.precision.mode, self.root_device)
        # The Trainer picks the precision before the XLA device exists; autocast must
        # target the device the model runs on.
        self.precision = Precision(self.precision.mode, self.root_device)

    def _xla(self) -> XLACollective:
        return self.engine_collective(XLACollective)

    @override
    def default_collective(self) -> Collective:
        return XLACollective()

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}  # XLA ranks come from the runtime

    @override
    def evaluation_context(self, inference_mode: bool) -> contextlib.AbstractContextManager[Any]:
        """`torch.no_grad` always: XLA's lazy tensors do not run under inference mode."""
        return torch.no_grad()

    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        output = super().step(model, name, *args)
        if name in _EVAL_STEPS:
            launch()
        return output

    def _average_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients across ranks (once per step)."""
        if self.gradient_sync == "native":
            self._xla().reduce_gradients(optimizer)
        else:
            gradients = [grad for _, grad in parameters_with_gradients(optimizer)]
            if gradients:
                launch(gradients)  # the backward pass, on its own
            if self.world_size > 1:
                for grad in gradients:
                    self.collective.all_reduce(grad, "mean", out=grad)
        self._reduced.add(id(optimizer))

    @override
    def _finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Clipping reads the averaged gradients; the step that follows does not average again.
        self._average_gradients(optimizer)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        closure: Callable[[], Any] | None = None,
    ) -> None:
        if closure is not None:
            raise ConfigurationError(
                f"{type(optimizer).__name__} needs a closure in step(); the XLA strategies "
                "step without one. Use an optimizer without a closure."
            )
        if id(optimizer) in self._reduced or self.gradient_sync == "collective":
            if id(optimizer) not in self._reduced:
                self._average_gradients(optimizer)
            self.precision.optimizer_step(optimizer)
        else:
            self._xla().optimizer_step(optimizer)
        self._reduced.discard(id(optimizer))
        launch()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> None:
        launch()
        with self.agree_on_save(path):
            if self.is_global_zero:
                save_checkpoint_file(move_to_device(checkpoint, torch.device("cpu")), path)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        super().load_module_state_dict(module, state, strict)
        launch()

    @override
    def teardown(self) -> None:
        if self._collective is not None and self._collective.is_setup:
            launch()
        super().teardown()
