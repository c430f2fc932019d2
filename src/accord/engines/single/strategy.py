"""`SingleDeviceStrategy`: one process, one device."""

from __future__ import annotations

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.one_device import OneDeviceStrategy
from accord.engines.single.collective import SingleDeviceCollective
from accord.environments.cluster_environment import ClusterEnvironment
from accord.precision import Precision

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(OneDeviceStrategy):
    """Train on one device in this process; communication is the identity.

    Args:
        device: the device to train on (default: CPU).
        accelerator, collective, cluster_environment, precision, debug: as `Strategy`.
    """

    def __init__(
        self,
        device: torch.device | str | int = "cpu",
        *,
        accelerator: Accelerator | None = None,
        collective: Collective | None = None,
        cluster_environment: ClusterEnvironment | None = None,
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
        self.device = torch.device(device)
        """The device this strategy trains on (the Trainer sets it from ``devices=``)."""

    @override
    def default_collective(self) -> Collective:
        return SingleDeviceCollective()
