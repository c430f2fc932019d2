"""`ParallelStrategy`: the shared base of strategies that run one process per device."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.strategy import Strategy
from accord.environments.cluster_environment import ClusterEnvironment
from accord.precision import Precision

__all__ = ["ParallelStrategy"]


class ParallelStrategy(Strategy):
    """One process per device on ``num_nodes`` machines.

    Args:
        parallel_devices: this node's devices, one per process (the Trainer fills it in).
        num_nodes: how many machines take part.
        accelerator, collective, cluster_environment, precision, debug: as `Strategy`.
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
        debug: bool = False,
    ) -> None:
        super().__init__(accelerator, collective, cluster_environment, precision, debug=debug)
        self.parallel_devices = parallel_devices
        self.num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def validate_cluster(self, num_devices: int, num_nodes: int) -> None:
        """Refuse a job the cluster environment cannot form, before any process starts.

        Strategies whose own launcher forms the group (Horovod) override it.
        """
        if self.cluster_environment is not None:
            self.cluster_environment.validate_settings(num_devices, num_nodes)

    def configure_ranks(self) -> None:
        """Tell the cluster environment the world size and this process's rank."""
        env = self.cluster_environment
        if env is None:
            return
        env.set_world_size(self.num_nodes * self.num_processes)
        env.set_global_rank(env.node_rank() * self.num_processes + env.local_rank())

    @override
    def setup_environment(self) -> None:
        self.configure_ranks()
        super().setup_environment()

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        env = self.cluster_environment
        if env is None:
            return {}
        return {
            "rank": env.global_rank(),
            "world_size": env.world_size(),
            "main_address": env.main_address,
            "main_port": env.main_port,
        }
