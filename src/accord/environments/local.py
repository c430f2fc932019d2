"""`LocalEnvironment`: one machine, ranks assigned by accord's own launcher."""

from __future__ import annotations

import os
import socket

from typing_extensions import override

from accord.environments.cluster_environment import ClusterEnvironment

__all__ = ["LocalEnvironment", "find_free_port"]


def find_free_port(address: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free on ``address`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class LocalEnvironment(ClusterEnvironment):
    """A single machine whose processes accord starts itself.

    The main address defaults to loopback (``127.0.0.1``) so nothing listens on other
    interfaces; a free port is picked once and handed to the child processes through
    ``MASTER_PORT``.
    """

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0
        self._port: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        # Child processes started by accord's launcher carry LOCAL_RANK.
        return "LOCAL_RANK" in os.environ

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        if self._port is None:
            self._port = find_free_port(self.main_address)
        return self._port

    @staticmethod
    @override
    def detect() -> bool:
        return True

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        return self._global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    @override
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @override
    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
