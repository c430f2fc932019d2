"""`HorovodEnvironment`: ranks as ``horovodrun`` (or ``mpirun``) gave them to this process.

Horovod forms its own group, so this environment only reads what the launcher set; the
`HorovodCollective` then reports Horovod's own view once it is set up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from typing_extensions import override

from accord.core.env_vars import env_number
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError

__all__ = ["HorovodEnvironment", "launched_by_horovod"]

# What horovodrun (gloo) or mpirun (Open MPI, MPICH/PMI) set in each process it starts.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_NODE_RANK_VARS = ("HOROVOD_CROSS_RANK",)


def launched_by_horovod() -> bool:
    """Whether this process was started by ``horovodrun`` (or ``mpirun``)."""
    return any(name in os.environ for name in _RANK_VARS)


def _launcher_int(names: Iterable[str], default: int) -> int:
    """The first of ``names`` that is set, as an integer; ``default`` when none is."""
    for name in names:
        if name in os.environ:
            return env_number(name, int, default)
    return default


class HorovodEnvironment(ClusterEnvironment):
    """Where this process sits, from the variables ``horovodrun`` or ``mpirun`` set.

    Outside such a launcher it is a group of one (rank 0 of 1). The rendezvous belongs to
    Horovod, so the address and port are the ones horovodrun's gloo rendezvous uses, for
    display only; the strategy computes nothing and sets nothing here.

    Raises:
        ConfigurationError: a launcher variable that is not an integer.
    """

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Refuse more than one process from a script that horovodrun did not start.

        The error shows the horovodrun command to use; under horovodrun every process
        trains on one device, and Horovod forms the group however many nodes there are.
        """
        requested = num_devices * num_nodes
        if requested <= 1 or launched_by_horovod():
            return
        script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "script.py"
        hosts = f" -H host1:{num_devices},host2:{num_devices},..." if num_nodes > 1 else ""
        raise ConfigurationError(
            f"HorovodStrategy does not start processes: horovodrun does. This run asks "
            f"for {requested} processes (devices={num_devices}, num_nodes={num_nodes}) but "
            f"was started as a single process. Run `horovodrun -np {requested}{hosts} "
            f"python {script}` instead; each process it starts trains on one device."
        )

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True  # horovodrun starts the processes, or there is only this one

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return _launcher_int(("HOROVOD_GLOO_RENDEZVOUS_PORT",), 0)

    @staticmethod
    @override
    def detect() -> bool:
        return launched_by_horovod()

    @override
    def world_size(self) -> int:
        return _launcher_int(_SIZE_VARS, 1)

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher fixes the world size."""

    @override
    def global_rank(self) -> int:
        return _launcher_int(_RANK_VARS, 0)

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher fixes the rank."""

    @override
    def local_rank(self) -> int:
        return _launcher_int(_LOCAL_RANK_VARS, 0)

    @override
    def node_rank(self) -> int:
        return _launcher_int(_NODE_RANK_VARS, 0)
