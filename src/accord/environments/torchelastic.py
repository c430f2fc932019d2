"""`TorchElasticEnvironment`: processes started by ``torchrun`` (torch.distributed.run)."""

from __future__ import annotations

import os

from typing_extensions import override

from accord.core.env_vars import env_number
from accord.environments.cluster_environment import _RanksFromVariables
from accord.errors import ConfigurationError

__all__ = ["TorchElasticEnvironment"]

_REQUIRED = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


class TorchElasticEnvironment(_RanksFromVariables):
    """Ranks, address and port as torchrun exports them; accord launches nothing."""

    _world_size_variable = "WORLD_SIZE"
    _global_rank_variable = "RANK"
    _local_rank_variable = "LOCAL_RANK"
    _node_rank_variable = "GROUP_RANK"

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    @override
    def detect() -> bool:
        return all(name in os.environ for name in _REQUIRED)

    @override
    def restart_count(self) -> int:
        """``TORCHELASTIC_RESTART_COUNT``: how often torchrun restarted the group (0 first)."""
        return env_number(
            "TORCHELASTIC_RESTART_COUNT",
            int,
            0,
            hint="torchrun sets it. Unset it, or start the job with torchrun",
        )

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        if num_devices != local:
            raise ConfigurationError(
                f"Trainer(devices={num_devices}) disagrees with torchrun's "
                f"--nproc-per-node={local}. Pass devices={local} (or 'auto')."
            )
        if num_nodes * local != self.world_size():
            raise ConfigurationError(
                f"Trainer(num_nodes={num_nodes}) with {local} processes per node does not "
                f"match torchrun's world size {self.world_size()}. Pass "
                f"num_nodes={self.world_size() // local}."
            )
