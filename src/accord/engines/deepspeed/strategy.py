"""`DeepSpeedStrategy`: data parallel training with a DeepSpeed engine and ZeRO stages 1-3.

DeepSpeed is imported only when a run starts (``setup_module``), so ``import accord`` and
building the registry never import it. How the Trainer's loop maps onto the engine:

- the model is wrapped in a `StepModule` and handed to ``deepspeed.initialize`` with the
  optimizer from ``configure_optimizers`` (unless the config names its own), so every step
  hook runs through the engine's ``forward`` (ZeRO-3 gathers parameters there);
- accumulation: the Trainer divides the loss by ``accumulate_grad_batches`` and says,
  through `no_backward_sync`, whether a batch ends a window; the strategy tells the engine
  (``set_gradient_accumulation_boundary``), calls ``engine.backward(loss,
  scale_wrt_gas=False)`` and ``engine.step()`` once per window, so a short last window of
  an epoch steps too, as on every other strategy;
- the config (`accord.engines.deepspeed.config`) takes accumulation, clipping and the
  `DeepSpeedPrecision` section from the Trainer's settings;
- checkpoints are directories in the atomic tag/latest format of
  `accord.engines.deepspeed.checkpoint_directory`, written and read by the methods it
  inherits from `accord.engines.deepspeed.strategy_checkpoints`; ZeRO-3's gathers are in
  `accord.engines.deepspeed.zero3`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.parallel import StartMethod
from accord.core.run_settings import RunSettings
from accord.core.step_module import StepModule
from accord.core.timeouts import DEFAULT_TIMEOUT
from accord.engines.deepspeed import zero3
from accord.engines.deepspeed.checkpoint_directory import consolidate_deepspeed_checkpoint
from accord.engines.deepspeed.collective import DeepSpeedCollective
from accord.engines.deepspeed.config import (
    build_config,
    evaluation_config,
    training_config,
    zero_stage,
)
from accord.engines.deepspeed.engine import initialize_engine, require_process_group
from accord.engines.deepspeed.precision import DeepSpeedPrecision
from accord.engines.deepspeed.strategy_checkpoints import DeepSpeedCheckpoints
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.imports import require
from accord.precision import Precision, PrecisionMode

__all__ = ["DeepSpeedPrecision", "DeepSpeedStrategy", "consolidate_deepspeed_checkpoint"]


class DeepSpeedStrategy(DeepSpeedCheckpoints):
    """Data parallel training through a DeepSpeed engine, with ZeRO stage 1, 2 or 3.

    The collective is a `DeepSpeedCollective` (DeepSpeed's communication module over a
    torch.distributed process group); the engine's ZeRO traffic runs on that group.
    Processes start as under ``ddp``: the script is re-run for each local rank
    (``start_method="popen"``) or the ranks are spawned/forked; under torchrun or SLURM
    nothing is started.

    Args:
        stage: the ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also
            parameters (default 2).
        offload_optimizer: keep optimizer states (and the step) on the CPU.
        offload_parameters: keep parameters on the CPU between uses (stage 3 only).
        config: a complete DeepSpeed config, as a dict or the path of a JSON file. Pass
            either ``config`` or ``stage``/``offload_*``/keyword entries, not both.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``, as `DDPStrategy`.
        process_group_backend, timeout: as `ParallelStrategy`, for the `DeepSpeedCollective`
            (the backend's default: gloo on CPU, the accelerator's own otherwise).
        **config_entries: more top-level DeepSpeed config entries, e.g.
            ``optimizer={"type": "Adam", "params": {"lr": 1e-3}}`` or
            ``zero_optimization={"overlap_comm": False}`` (merged with ``stage``).
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes, debug:
            as `ParallelStrategy`.

    When a run starts, the config takes ``gradient_accumulation_steps``,
    ``gradient_clipping`` and ``fp16``/``bf16`` from the Trainer (a config that contradicts
    it raises `ConfigurationError`). The optimizer from ``configure_optimizers`` is used
    unless the config names one; then DeepSpeed builds it, and LR schedulers from
    ``configure_optimizers`` drive nothing: put the scheduler in the config as well.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        ConfigurationError: invalid options.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        stage: int | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: dict[str, Any] | str | Path | None = None,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        debug: bool = False,
        **config_entries: Any,
    ) -> None:
        require("deepspeed", "DeepSpeedStrategy")
        super().__init__(
            accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            collective=collective,
            precision=precision,
            num_nodes=num_nodes,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            debug=debug,
        )
        self.config = build_config(
            stage, offload_optimizer, offload_parameters, config, config_entries
        )
        self.engine_config: dict[str, Any] | None = None
        """The config the current engine was built with (None before a run)."""
        self._engine: Any = None
        self._step_module: StepModule | None = None
        self._trains = False

    # ---------------------------------------------------------------- options
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (1, 2 or 3)."""
        return zero_stage(self.config)

    @property
    @override
    def compile_refusal(self) -> str | None:
        """ZeRO-3 cannot train a compiled model; ZeRO-1 and 2 can."""
        if self.zero_stage != 3:
            return None
        return (
            "ZeRO-3 gathers each submodule's parameters in hooks around its forward, which "
            "a compiled module bypasses or torch.compile traces again every step (ZeRO "
            "stages 1 and 2 train compiled models)."
        )

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` of the current run (None outside a run)."""
        return self._engine

    @property
    def precision(self) -> DeepSpeedPrecision:
        """The `DeepSpeedPrecision`; any `Precision` assigned is converted to one."""
        return self._precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        if not isinstance(precision, DeepSpeedPrecision):
            precision = DeepSpeedPrecision(precision.mode, precision.device_type)
        self._precision = precision

    @override
    def check_precision(self, mode: PrecisionMode, device: torch.device) -> None:
        super().check_precision(mode, device)
        if mode is PrecisionMode.FP16_TRUE and device.type == "cpu":
            # The engine would raise "Type fp16 is not supported on your device" only once
            # every rank has started.
            raise ConfigurationError(
                "precision='16-true' runs DeepSpeed's fp16 engine, which needs a CUDA device; "
                "on CPU use precision='bf16-true' or 'bf16-mixed'."
            )

    @override
    def check_manual_optimization(self) -> None:
        """Refuse manual optimization: DeepSpeed's engine owns the one optimizer.

        Raises:
            ConfigurationError: always.
        """
        raise ConfigurationError(
            "Manual optimization (automatic_optimization = False) does not run on "
            "DeepSpeedStrategy: the DeepSpeed engine owns one optimizer and runs its "
            "backward, gradient accumulation and step itself, so training_step cannot call "
            "manual_backward or step optimizers. Use automatic optimization with one "
            "optimizer on DeepSpeed, or strategy='ddp' for manual optimization."
        )

    @override
    def default_collective(self) -> Collective:
        return DeepSpeedCollective(self.process_group_backend, timeout=self.timeout)

    # ------------------------------------------------------------- the engine
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._release_engine(gather=False)
        module = super().setup_module(module)
        require_process_group(type(self.collective).__name__)
        self._step_module = StepModule(module)
        return self._step_module

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Build the engine around the model and the optimizer; return the engine's optimizer."""
        if len(optimizers) != 1:
            raise ConfigurationError(
                f"DeepSpeedStrategy trains with exactly one optimizer, but "
                f"configure_optimizers() returned {len(optimizers)}."
            )
        engine = self._init_engine(optimizers[0])
        return [cast(torch.optim.Optimizer, engine.optimizer)]

    def _init_engine(self, optimizer: torch.optim.Optimizer | None) -> Any:
        """``deepspeed.initialize`` for training (with ``optimizer``) or evaluation (None)."""
        if self._step_module is None:
            raise ConfigurationError("setup_module() must run before the DeepSpeed engine starts.")
        if optimizer is None:
            config = evaluation_config(self.config, self.precision)
        else:
            config = training_config(
                self.config, self.run_settings, self.precision, self.root_device.type
            )
        self.engine_config = config
        self._engine = initialize_engine(self._step_module, config, optimizer)
        self._trains = optimizer is not None
        return self._engine

    def _ensure_engine(self) -> Any:
        return self._engine if self._engine is not None else self._init_engine(None)

    # ------------------------------------------------------------ training step
    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        return self._ensure_engine()(name, *args)

    @override
    def on_train_batch_start(self, batch_idx: int, last: bool, window_ends: bool = True) -> None:
        """Tell the engine whether this batch ends an accumulation window."""
        if self._engine is not None and self._trains:
            self._engine.set_gradient_accumulation_boundary(window_ends)

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Tell the engine whether this batch ends an accumulation window (``not enabled``)."""
        if self._engine is not None and self._trains:
            self._engine.set_gradient_accumulation_boundary(not enabled)
        return contextlib.nullcontext()

    @override
    def refused_module_hooks(self) -> dict[str, str]:
        """The DeepSpeed engine runs backward, clipping and zeroing itself."""
        return {
            "backward": "DeepSpeed's engine runs the backward pass itself (engine.backward, "
            "with its loss scaling and partitioned gradients).",
            "optimizer_zero_grad": "DeepSpeed's engine clears the gradients inside engine.step().",
            "configure_gradient_clipping": "DeepSpeed's engine clips inside engine.step(), to "
            "the gradient_clipping of its config: set Trainer(gradient_clip_val=...) instead.",
        }

    @override
    def configure_run(self, settings: RunSettings) -> None:
        if settings.gradient_clip_val is not None and settings.gradient_clip_algorithm != "norm":
            raise ConfigurationError(
                "DeepSpeedStrategy clips gradients by norm only (inside engine.step()); "
                "gradient_clip_algorithm='value' cannot run on it. Use 'norm', or ddp/fsdp."
            )
        super().configure_run(settings)

    @override
    def backward(
        self,
        loss: torch.Tensor,
        module: nn.Module,
        backward_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``engine.backward``; the Trainer already divided the loss for accumulation."""
        self._require_training("backward")
        self._engine.backward(loss, scale_wrt_gas=False)

    @override
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """DeepSpeed clips inside ``engine.step()`` (config ``gradient_clipping``).

        Returns NaN: the norm is only known after the step (``engine.get_global_grad_norm()``).

        Raises:
            ConfigurationError: ``max_norm`` is not the value the engine was built with.
        """
        self._require_training("clip_gradients")
        configured = float(self._engine.gradient_clipping())
        if configured != float(max_norm):
            raise ConfigurationError(
                f"The DeepSpeed engine clips gradients to {configured}, set when it was built; "
                f"it cannot clip to {max_norm} now. Set gradient_clip_val before fit()."
            )
        return torch.tensor(float("nan"))

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_value: float
    ) -> None:
        """Refused: the engine clips by norm only.

        Raises:
            ConfigurationError: always.
        """
        raise ConfigurationError(
            "DeepSpeedStrategy cannot clip gradients by value: its engine clips by norm, "
            "inside engine.step(). Use gradient_clip_algorithm='norm'."
        )

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        closure: Callable[[], Any] | None = None,
    ) -> None:
        """``engine.step()``: reduce the window's gradients, clip, step, zero the gradients.

        Raises:
            ConfigurationError: an optimizer that needs a closure (the engine steps
                without one).
        """
        self._require_training("optimizer_step")
        if closure is not None:
            raise ConfigurationError(
                f"{type(optimizer).__name__} needs a closure in step(), which DeepSpeed's "
                "engine.step() cannot pass; use an optimizer without one (SGD, Adam, ...)."
            )
        self._engine.step()

    @override
    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """Nothing to do: ``engine.step()`` already cleared the gradients."""

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        target: Any = module
        if self._engine is not None and target is self._engine:
            target = self._engine.module
        if isinstance(target, StepModule):
            target = target.module
        return cast(nn.Module, target)

    def _require_training(self, what: str) -> None:
        if self._engine is None or not self._trains:
            raise ConfigurationError(
                f"DeepSpeedStrategy.{what}() needs the training engine; it is built by "
                "setup_optimizers() during fit()."
            )

    # --------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        # After an error on some rank the others may never join a gather: skip it then.
        self._release_engine(gather=sys.exc_info()[0] is None)
        super().teardown()

    def _release_engine(self, gather: bool) -> None:
        """Drop the engine; under ZeRO-3 first put the full weights back into the model.

        ZeRO-3 leaves every parameter partitioned (empty on each rank). With ``gather``,
        each module's parameters are gathered and replaced by plain full parameters, so
        after ``fit`` the model holds the trained weights (as under every other strategy);
        every rank must take part.
        """
        engine, self._engine = self._engine, None
        if engine is None:
            return
        step_module = self._step_module
        if gather and self.zero_stage == 3 and step_module is not None:
            zero3.materialize_parameters(step_module.module)
        engine.destroy()
        self._trains = False

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(stage={self.zero_stage}, "
            f"collective={type(self.collective).__name__})"
        )
