"""`XLAStrategy` and `SingleDeviceXLAStrategy`: training on XLA devices through torch_xla.

torch_xla is imported only when a run starts, so building the registry never imports
it; building either strategy without torch_xla raises `MissingDependencyError`, which
says how to install it.

How the Trainer's loop maps onto XLA's lazy execution:

- forward and backward only record a graph; the optimizer step is where it runs.
  `optimizer_step` first runs the backward graph (so the step program holds device data
  only), then calls ``xm.optimizer_step`` (it averages the gradients across ranks with
  ``xm.all_reduce`` and steps the optimizer) and launches the result: one compiled
  program per step. With ``gradient_sync="collective"`` the strategy's collective
  averages the gradients instead, so an injected collective also carries them;
- gradient clipping needs the averaged gradients, so `clip_gradients` averages them
  first and the step that follows does not average again (the order DDP gives);
- validation, test and predict steps are launched after each batch, so an evaluation
  loop does not grow one graph over all its batches;
- checkpoints: every tensor is copied to the CPU and rank 0 writes an ordinary accord
  checkpoint file, which loads on any strategy; loading moves the tensors back.

Where ranks share a process (torch_xla's CPU runtime, several TPU cores per chip), every
rank must build the same step program, as on any XLA runtime: keep rank-dependent Python
branches out of the training step. XLA's CPU runtime also ends the process when one rank
reaches a collective more than about 15 seconds after another.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.checkpoint_io import save_checkpoint_file
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy
from accord.core.strategy import Strategy, move_to_device
from accord.engines.single.strategy import SingleDeviceStrategy
from accord.engines.xla.collective import XLACollective, launch, require_torch_xla
from accord.engines.xla.launcher import XLALauncher
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision, PrecisionMode

_NARROW = (torch.bfloat16, torch.float16)

__all__ = ["SingleDeviceXLAStrategy", "XLAStrategy"]

GradientSync = Literal["native", "collective"]

_EVAL_STEPS = frozenset({"validation_step", "test_step", "predict_step"})


def _xla_accelerator(accelerator: Accelerator | None) -> Accelerator:
    if accelerator is not None:
        return accelerator
    from accord.engines.xla.accelerator import XLAAccelerator

    return XLAAccelerator()


class _XLATraining(Strategy):
    """What both XLA strategies do the same way: step, clip, launch, checkpoint."""

    gradient_sync: GradientSync = "native"
    _reduced: set[int]

    def _xla_device(self) -> torch.device:
        import torch_xla

        return torch.device(torch_xla.device())

    def _check_precision(self) -> None:
        if self.precision.mode is PrecisionMode.FP16_MIXED:
            raise ConfigurationError(
                "precision='16-mixed' needs CUDA's gradient scaler, which XLA devices do not "
                "have. Use precision='bf16-mixed' or 'bf16-true' on XLA."
            )
        # The Trainer picks the precision before the XLA device exists; autocast must
        # target the device the model runs on.
        self.precision = Precision(self.precision.mode, self.root_device)

    @override
    def default_collective(self) -> Collective:
        return XLACollective()

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}  # XLA ranks come from the runtime

    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        output = super().step(model, name, *args)
        if name in _EVAL_STEPS:
            launch()
        return output

    def _gradients(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def _average_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients across ranks (once per step)."""
        gradients = self._gradients(optimizer)
        if gradients:
            launch(gradients)  # the backward pass, on its own
        if self.world_size > 1:
            if self.gradient_sync == "collective":
                for grad in gradients:
                    self.collective.all_reduce(grad, "mean", out=grad)
            else:
                import torch_xla.core.xla_model as xm

                if any(grad.dtype in _NARROW for grad in gradients):
                    # XLA's CPU runtime has no bfloat16/float16 all-reduce: those gradients
                    # are averaged as float32, then given back in their own dtype.
                    params = [p for g in optimizer.param_groups for p in g["params"]]
                    params = [p for p in params if p.grad is not None]
                    wide = [p.grad.to(torch.float32) for p in params]
                    xm.all_reduce(xm.REDUCE_SUM, wide, scale=1.0 / self.world_size)
                    for param, averaged in zip(params, wide, strict=True):
                        param.grad = averaged.to(param.dtype)
                    gradients = self._gradients(optimizer)
                else:
                    xm.reduce_gradients(optimizer)
                launch(gradients)
        self._reduced.add(id(optimizer))

    @override
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        self._average_gradients(optimizer)
        return super().clip_gradients(module, optimizer, max_norm)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        if id(optimizer) in self._reduced or self.gradient_sync == "collective":
            if id(optimizer) not in self._reduced:
                self._average_gradients(optimizer)
            self.precision.optimizer_step(optimizer)
        else:
            import torch_xla.core.xla_model as xm

            gradients = self._gradients(optimizer)
            if gradients:
                launch(gradients)  # the backward pass, on its own
            xm.optimizer_step(optimizer)
        self._reduced.discard(id(optimizer))
        launch()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> None:
        launch()
        if self.is_global_zero:
            save_checkpoint_file(move_to_device(checkpoint, torch.device("cpu")), path)
        self.barrier("save_checkpoint")

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


class XLAStrategy(_XLATraining, ParallelStrategy):
    """Data parallel training on several XLA devices, one rank per device.

    The collective is an `XLACollective`, ranks come from an `XLAEnvironment`, and
    `XLALauncher` starts them with torch_xla's ``xmp.spawn`` (on the CPU runtime: one
    process, one thread per device). Inside ranks that something else started (your own
    ``xmp.spawn``), nothing is launched.

    Args:
        gradient_sync: ``"native"`` averages gradients with ``xm.optimizer_step`` /
            ``xm.reduce_gradients`` (XLA's own bucketed all_reduce); ``"collective"``
            sends every gradient through ``self.collective.all_reduce``, so an injected
            collective also carries the gradients.
        sync_module_states: broadcast rank 0's parameters and buffers when the model is
            set up, so every rank starts from the same weights.
        failure_grace: seconds the other ranks get to stop after one failed.
        debug: check that all ranks make the same collective calls (`DebugCollective`).
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes:
            as `ParallelStrategy` (the accelerator defaults to `XLAAccelerator`, the
            environment to `XLAEnvironment`).

    Raises:
        MissingDependencyError: torch_xla is not installed.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        *,
        gradient_sync: GradientSync = "native",
        sync_module_states: bool = True,
        failure_grace: float = 5.0,
        debug: bool = False,
    ) -> None:
        require_torch_xla("strategy='xla'")
        if gradient_sync not in ("native", "collective"):
            raise ConfigurationError(
                f"gradient_sync={gradient_sync!r}: use 'native' or 'collective'."
            )
        if cluster_environment is None:
            from accord.engines.xla.environment import XLAEnvironment

            cluster_environment = XLAEnvironment()
        super().__init__(
            _xla_accelerator(accelerator),
            parallel_devices,
            cluster_environment,
            collective,
            precision,
            num_nodes,
            debug=debug,
        )
        self.gradient_sync = gradient_sync
        self.sync_module_states = sync_module_states
        self.failure_grace = failure_grace
        self._device: torch.device | None = None
        self._reduced = set()

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        # Before the run: the first configured device (the runtime is not started yet).
        return self.parallel_devices[0] if self.parallel_devices else torch.device("xla", 0)

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if env is None or env.creates_processes_externally or self.num_processes == 1:
            self._launcher = None
        else:
            self._launcher = XLALauncher(env, self.num_processes, self.failure_grace)

    @override
    def setup_environment(self) -> None:
        self._device = self._xla_device()
        self._check_precision()
        super().setup_environment()
        expected = self.num_nodes * self.num_processes
        if self.collective.world_size != expected:
            raise ConfigurationError(
                f"The Trainer asked for {expected} XLA rank(s) but the runtime runs "
                f"{self.collective.world_size}. torch_xla launches one rank per device of the "
                "runtime: pass devices to match (on the CPU runtime, CPU_NUM_DEVICES), and "
                "do not use the XLA device before trainer.fit()."
            )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.sync_module_states and self.world_size > 1:
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    self.collective.broadcast(tensor.data, src=0, out=tensor.data)
        return module

    @override
    def teardown(self) -> None:
        super().teardown()
        self._device = None


class SingleDeviceXLAStrategy(_XLATraining, SingleDeviceStrategy):
    """Train on one XLA device in this process (a TPU core, or the XLA CPU runtime).

    The collective is an `XLACollective` on a world of one.

    Args:
        device: the XLA device (default: ``xla:0``).
        accelerator, collective, cluster_environment, precision, debug: as `SingleDeviceStrategy`
            (the accelerator defaults to `XLAAccelerator`).

    Raises:
        MissingDependencyError: torch_xla is not installed.
    """

    def __init__(
        self,
        device: torch.device | str | int = "xla",
        accelerator: Accelerator | None = None,
        collective: Collective | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        *,
        debug: bool = False,
    ) -> None:
        require_torch_xla("strategy='single_xla'")
        if isinstance(device, int):
            device = torch.device("xla", device)
        super().__init__(
            device,
            _xla_accelerator(accelerator),
            collective,
            cluster_environment,
            precision,
            debug=debug,
        )
        if self._device.type != "xla":
            raise ConfigurationError(
                f"SingleDeviceXLAStrategy trains on an XLA device, got device={device!r}."
            )
        self._reduced = set()

    @override
    def setup_environment(self) -> None:
        self._check_precision()
        super().setup_environment()
