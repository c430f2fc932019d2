"""`XLAStrategy` and `SingleDeviceXLAStrategy`: training on XLA devices through torch_xla.

torch_xla is imported only when a run starts, so building the registry never imports
it; building either strategy without torch_xla raises `MissingDependencyError`, which
says how to install it.

How the Trainer's loop maps onto XLA's lazy execution (`XLAStrategyBase`):

- forward and backward only record a graph; the optimizer step is where it runs.
  `optimizer_step` first runs the backward graph (so the step program holds device data
  only), then the `XLACollective` averages the gradients across ranks with XLA's own
  all-reduce and steps the optimizer (`XLACollective.optimizer_step`), and the result is
  launched: one compiled program per step. With ``gradient_sync="collective"`` the
  strategy's collective averages each gradient instead, so an injected collective also
  carries them;
- gradient clipping needs the averaged gradients, so `clip_gradients` averages them
  first and the step that follows does not average again (the order DDP gives);
- validation, test and predict steps are launched after each batch, so an evaluation
  loop does not grow one graph over all its batches;
- checkpoints: every tensor is copied to the CPU and rank 0 writes an ordinary accord
  checkpoint file, which loads on any strategy; loading moves the tensors back.

Where ranks share a process (torch_xla's CPU runtime, several TPU cores per chip), every
rank must build the same step program, as on any XLA runtime: keep rank-dependent Python
branches out of the training step. XLA's CPU runtime also ends the process when one rank
reaches a collective more than about 15 seconds after another. Such ranks also share
torch's CPU random generator: a module that each rank seeds and builds in its own code
draws its initial weights while the other ranks reseed and draw, so rank 0's weights
(which ``sync_module_states`` gives every rank) need not be the ones the seed gives. Build
the module before the ranks start, as ``trainer.fit(model)`` under `XLAStrategy` does (each
rank unpickles its own copy).
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.one_device import OneDeviceStrategy
from accord.core.parallel import ParallelStrategy
from accord.engines.xla.accelerator import XLAAccelerator
from accord.engines.xla.base import GradientSync, XLAStrategyBase
from accord.engines.xla.environment import XLAEnvironment
from accord.engines.xla.launcher import XLALauncher
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.imports import require
from accord.precision import Precision

__all__ = ["SingleDeviceXLAStrategy", "XLAStrategy"]


def _xla_accelerator(accelerator: Accelerator | None) -> Accelerator:
    return accelerator if accelerator is not None else XLAAccelerator()


class XLAStrategy(XLAStrategyBase, ParallelStrategy):
    """Data parallel training on several XLA devices, one rank per device.

    The collective is an `XLACollective`, ranks come from an `XLAEnvironment`, and
    `XLALauncher` starts them with torch_xla's ``xmp.spawn`` (on the CPU runtime: one
    process, one thread per device). Inside ranks that something else started (your own
    ``xmp.spawn``), nothing is launched.

    Args:
        gradient_sync: ``"native"`` averages gradients with XLA's own bucketed
            all-reduce (`XLACollective.optimizer_step` / `XLACollective.reduce_gradients`);
            ``"collective"`` sends every gradient through ``self.collective.all_reduce``,
            so an injected collective also carries the gradients.
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
        *,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        gradient_sync: GradientSync = "native",
        sync_module_states: bool = True,
        failure_grace: float = 5.0,
        debug: bool = False,
    ) -> None:
        require("torch_xla", "strategy='xla'")
        if gradient_sync not in ("native", "collective"):
            raise ConfigurationError(
                f"gradient_sync={gradient_sync!r}: use 'native' or 'collective'."
            )
        super().__init__(
            _xla_accelerator(accelerator),
            parallel_devices=parallel_devices,
            cluster_environment=(
                cluster_environment if cluster_environment is not None else XLAEnvironment()
            ),
            collective=collective,
            precision=precision,
            num_nodes=num_nodes,
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

    @property
    @override
    def launches_own_processes(self) -> bool:
        """True: `XLALauncher` (``xmp.spawn``) starts the ranks from the calling process."""
        return True

    @override
    def configure_launcher(self) -> None:
        env = self.cluster_environment
        if env is None or env.creates_processes_externally or self.num_processes == 1:
            self._launcher = None
        else:
            self._launcher = XLALauncher(env, self.num_processes, self.failure_grace)

    @override
    def setup_environment(self) -> None:
        self._device = self._xla_device()
        self._precision_on_device()
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


class SingleDeviceXLAStrategy(XLAStrategyBase, OneDeviceStrategy):
    """Train on one XLA device in this process (a TPU core, or the XLA CPU runtime).

    The collective is an `XLACollective` on a world of one.

    Args:
        device: the XLA device (default: ``xla:0``).
        accelerator, collective, cluster_environment, precision, debug: as `Strategy`
            (the accelerator defaults to `XLAAccelerator`).

    Raises:
        MissingDependencyError: torch_xla is not installed.
        ConfigurationError: ``device`` is not an XLA device.
    """

    def __init__(
        self,
        device: torch.device | str | int = "xla",
        *,
        accelerator: Accelerator | None = None,
        collective: Collective | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        debug: bool = False,
    ) -> None:
        require("torch_xla", "strategy='single_xla'")
        super().__init__(
            _xla_accelerator(accelerator),
            collective=collective,
            cluster_environment=cluster_environment,
            precision=precision,
            debug=debug,
        )
        self.device = (
            torch.device("xla", device) if isinstance(device, int) else torch.device(device)
        )
        """The XLA device this strategy trains on."""
        if self.device.type != "xla":
            raise ConfigurationError(
                f"SingleDeviceXLAStrategy trains on an XLA device, got device={device!r}."
            )
        self._reduced = set()

    @override
    def setup_environment(self) -> None:
        self._precision_on_device()
        super().setup_environment()
