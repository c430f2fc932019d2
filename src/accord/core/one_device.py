"""`OneDeviceStrategy`: the base of strategies that train on one device in one process.

Whatever the engine (a CPU or CUDA device, one XLA device), such a strategy has a world of
one, a device the Trainer picks from ``devices=``, and no rendezvous; the Trainer treats
every subclass the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from accord.core.strategy import Strategy
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """A strategy on one device, in this process only.

    Attributes:
        device: the device to train on; the Trainer sets it from ``devices=``.
    """

    device: torch.device

    @property
    @override
    def root_device(self) -> torch.device:
        return self.device

    @override
    def configure_devices(
        self, devices: list[torch.device], num_nodes: int, environment: ClusterEnvironment
    ) -> None:
        """Train on the one device named; one process needs no cluster environment.

        Raises:
            ConfigurationError: more than one device, or more than one node.
        """
        if len(devices) > 1 or num_nodes > 1:
            raise ConfigurationError(
                f"{type(self).__name__} trains on one device, but the Trainer's devices= and "
                f"num_nodes={num_nodes} ask for {len(devices) * num_nodes}. Use "
                "strategy='ddp', or devices=1."
            )
        self.device = devices[0]

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}
