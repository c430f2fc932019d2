"""`DPStrategy`: one process drives all local GPUs with `torch.nn.DataParallel`."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import WarningCache
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.step_module import StepModule
from accord.core.strategy import Strategy
from accord.engines.single.collective import SingleDeviceCollective
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision

__all__ = ["DPStrategy"]

# Each warning once per process, however many fits run in it.
_WARNINGS = WarningCache()


class DPStrategy(Strategy):
    """Split each batch across the local GPUs in one process (`torch.nn.DataParallel`).

    There is one process, so the collective is a `SingleDeviceCollective`. On CPU,
    DataParallel runs a single replica; accord says so once. Prefer ``ddp``: DataParallel
    is single-node and slower.

    Args:
        parallel_devices: the devices to replicate over (the Trainer fills it in).
        accelerator, collective, cluster_environment, precision, debug: as `Strategy`.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        debug: bool = False,
    ) -> None:
        super().__init__(
            accelerator,
            collective=collective,
            cluster_environment=cluster_environment,
            precision=precision,
            debug=debug,
        )
        self.parallel_devices = parallel_devices or [torch.device("cpu")]

    @override
    def default_collective(self) -> Collective:
        return SingleDeviceCollective()

    @override
    def configure_devices(
        self, devices: list[torch.device], num_nodes: int, environment: ClusterEnvironment
    ) -> None:
        """Replicate over this machine's devices.

        Raises:
            ConfigurationError: more than one node.
        """
        if num_nodes > 1:
            raise ConfigurationError(
                "strategy='dp' (DataParallel) runs in one process on one machine, but "
                f"num_nodes={num_nodes}. Use strategy='ddp' for several machines."
            )
        self.parallel_devices = devices
        super().configure_devices(devices, num_nodes, environment)

    @property
    @override
    def compile_refusal(self) -> str | None:
        """DataParallel's replicas would all run the original's compiled code."""
        return (
            "DataParallel copies the module onto each GPU every step, and each copy of a "
            "compiled module would run the original's compiled code on the original's "
            "weights."
        )

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.root_device.type != "cuda":
            _WARNINGS.warn(
                "strategy='dp' on CPU runs one replica: DataParallel only splits batches "
                "across CUDA devices. Use strategy='ddp' to train with several CPU processes.",
                category=UserWarning,
                stacklevel=6,  # the caller of setup_module, past WarningCache's own frames
            )
            return nn.DataParallel(StepModule(module), device_ids=[])
        ids = [device.index for device in self.parallel_devices if device.index is not None]
        return nn.DataParallel(StepModule(module), device_ids=ids, output_device=ids[0])

    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        if isinstance(model, nn.DataParallel):
            output = model(name, *args)
            return _mean_of_replicas(output) if len(model.device_ids) > 1 else output
        return super().step(model, name, *args)

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        if isinstance(module, nn.DataParallel):
            module = module.module
        if isinstance(module, StepModule):
            module = module.module
        return module


def _mean_of_replicas(output: Any) -> Any:
    """DataParallel gathers each replica's scalar loss into a vector; average it back."""
    if isinstance(output, torch.Tensor) and output.dim() == 1:
        return output.mean()
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
        return {**output, "loss": loss.mean() if loss.dim() == 1 else loss}
    return output
