"""`ClusterEnvironment`: where a process sits in the job (ranks, main address and port)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import ClassVar

from typing_extensions import override

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

    def requeue(self) -> bool:
        """Ask the scheduler to run this job again; return whether it was requeued.

        Called on global rank zero after a preemption signal's checkpoint was saved. The
        default does nothing and returns False.
        """
        return False

    def restart_count(self) -> int:
        """How many times the job was restarted (0 on the first run).

        A Trainer whose job was restarted resumes from the newest finished checkpoint by
        itself (``Trainer(auto_resume=True)``). The default is 0.
        """
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _RanksFromVariables(ClusterEnvironment):
    """An environment whose launcher started every process and exported its ranks in the
    environment variables a subclass names; the strategy's own values are ignored."""

    _world_size_variable: ClassVar[str]
    _global_rank_variable: ClassVar[str]
    _local_rank_variable: ClassVar[str]
    _node_rank_variable: ClassVar[str]

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @override
    def world_size(self) -> int:
        return int(os.environ[self._world_size_variable])

    @override
    def set_world_size(self, size: int) -> None:
        pass

    @override
    def global_rank(self) -> int:
        return int(os.environ[self._global_rank_variable])

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return int(os.environ[self._local_rank_variable])

    @override
    def node_rank(self) -> int:
        return int(os.environ[self._node_rank_variable])
