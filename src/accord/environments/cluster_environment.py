"""`ClusterEnvironment`: where a process sits in the job (ranks, main address and port)."""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["ClusterEnvironment"]


class ClusterEnvironment(ABC):
    """Facts about the cluster a process runs in; the strategy asks, never guesses."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether something outside accord (torchrun, SLURM, a launcher) started the ranks."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Address of the rank-zero host that the process group rendezvous at."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port on `main_address` for the rendezvous."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether the current process runs in this kind of environment."""

    @abstractmethod
    def world_size(self) -> int:
        """Total number of processes in the job."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        """Record the world size the strategy computed (ignored where the cluster fixes it)."""

    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process among all processes."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        """Record the global rank the strategy computed (ignored where the cluster fixes it)."""

    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its node."""

    @abstractmethod
    def node_rank(self) -> int:
        """Rank of this process's node."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise if the Trainer's ``devices``/``num_nodes`` contradict the cluster."""

    def teardown(self) -> None:
        """Undo what this environment changed in the process (nothing by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
