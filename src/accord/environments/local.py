"""`LocalEnvironment`: one machine, ranks assigned by accord's own launcher."""

from __future__ import annotations

import os
import shlex
import socket
import sys

from typing_extensions import override

from accord.core.env_vars import env_number
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError

__all__ = ["LocalEnvironment", "find_free_port"]


def find_free_port(address: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free on ``address`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class LocalEnvironment(ClusterEnvironment):
    """A single machine whose processes accord starts itself.

    The main address defaults to loopback (``127.0.0.1``), so nothing listens on other
    interfaces: rank 0's rendezvous and watchdog stores bind that address only, and gloo
    the loopback interface (see `accord.core.rendezvous.listen_on_loopback`). A free port
    is picked once and handed to the child processes through ``MASTER_PORT``. A job of several machines started without torchrun or SLURM needs
    ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK`` on every machine; without them
    `validate_settings` refuses it, since no machine could find the others.
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
        return env_number("LOCAL_RANK", int, 0)

    @override
    def node_rank(self) -> int:
        return env_number("NODE_RANK", int, env_number("GROUP_RANK", int, 0))

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """With ``num_nodes > 1``, require the variables that let the machines meet.

        Each machine's ranks would otherwise default to node 0 on a loopback address and
        a port of their own, and wait for the other nodes forever without a word.
        """
        if num_nodes == 1:
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if "NODE_RANK" not in os.environ and "GROUP_RANK" not in os.environ:
            missing.append("NODE_RANK")
        if missing:
            raise ConfigurationError(_multi_node_help(missing, num_devices, num_nodes))
        raw = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", ""))
        if not raw.strip().isdigit() or int(raw) >= num_nodes:
            last = "0 or 1" if num_nodes == 2 else f"0 to {num_nodes - 1}"
            raise ConfigurationError(
                f"NODE_RANK={raw} does not fit a job of num_nodes={num_nodes}: set it to "
                f"{last}, a different value on each machine (0 on the machine at MASTER_ADDR)."
            )


def _multi_node_help(missing: list[str], num_devices: int, num_nodes: int) -> str:
    """The error for a multi-node run without its rendezvous variables: what to run where."""
    names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
    verb = "is" if len(missing) == 1 else "are"
    given = os.environ.get("MASTER_ADDR")
    address = shlex.quote(given) if given is not None else "<node-0-address>"
    port = shlex.quote(os.environ.get("MASTER_PORT", "29500"))
    script = shlex.join(sys.argv) if sys.argv and sys.argv[0] not in ("", "-c") else "train.py"
    rendezvous = f"MASTER_ADDR={address} MASTER_PORT={port}"
    other = "1" if num_nodes == 2 else f"<1..{num_nodes - 1}>"
    return (
        f"num_nodes={num_nodes} asks for {num_nodes} machines, but {names} {verb} not set "
        "and no torchrun or SLURM environment was found, so the machines cannot find each "
        "other: the run would wait for the other nodes forever. Start the same command on "
        "every machine, with MASTER_ADDR the address of node 0 as the others reach it (this "
        f"machine is {socket.gethostname()!r}) and MASTER_PORT a port free there:\n\n"
        f"    {rendezvous} NODE_RANK=0 python {script}   # on node 0\n"
        f"    {rendezvous} NODE_RANK={other} python {script}   # on node {other}\n\n"
        "or with torchrun on every machine, each with its own --node-rank:\n\n"
        f"    torchrun --nnodes {num_nodes} --node-rank {other} --nproc-per-node {num_devices} "
        f"--master-addr {address} --master-port {port} {script}\n\n"
        "See 'Multi-node' in accord's documentation."
    )
