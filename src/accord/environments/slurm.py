"""`SLURMEnvironment`: processes started by ``srun`` under a SLURM allocation."""

from __future__ import annotations

import os
import re

from typing_extensions import override

from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError

__all__ = ["SLURMEnvironment"]


class SLURMEnvironment(ClusterEnvironment):
    """Ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``; one task per device.

    The main address is the first host of ``SLURM_NODELIST``; the port is ``MASTER_PORT``
    if set, else derived from the job id so every task computes the same one.
    """

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        return first_host(os.environ.get("SLURM_NODELIST", "127.0.0.1"))

    @property
    @override
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        job_id = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
        return 10000 + job_id % 20000

    @staticmethod
    @override
    def detect() -> bool:
        # An interactive `salloc` shell also has SLURM_NTASKS; srun tasks have SLURM_STEP_ID.
        return "SLURM_NTASKS" in os.environ and "SLURM_STEP_ID" in os.environ

    @override
    def world_size(self) -> int:
        return int(os.environ["SLURM_NTASKS"])

    @override
    def set_world_size(self, size: int) -> None:
        pass

    @override
    def global_rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return int(os.environ["SLURM_LOCALID"])

    @override
    def node_rank(self) -> int:
        return int(os.environ["SLURM_NODEID"])

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
        if per_node and per_node.isdigit() and int(per_node) != num_devices:
            raise ConfigurationError(
                f"Trainer(devices={num_devices}) disagrees with --ntasks-per-node={per_node}. "
                "Request one SLURM task per device."
            )
        if num_nodes * num_devices != self.world_size():
            raise ConfigurationError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) needs "
                f"{num_devices * num_nodes} SLURM tasks, but SLURM_NTASKS={self.world_size()}."
            )


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list such as ``gpu[003-005,9],cpu1``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^(.*?)\[(\d+)", first)
    return f"{match.group(1)}{match.group(2)}" if match else first
