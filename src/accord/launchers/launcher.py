"""`Launcher`: starts the processes a strategy needs and runs the work in each.

The contract: `Launcher.launch` runs ``fn`` on every local rank and returns what it
returned on local rank zero. Whether the caller's own objects see the work depends on
`Launcher.runs_in_caller`: when the calling process is local rank zero (the script is
re-run for the other ranks), they do; when every rank is a new process (spawn, fork,
XLA), only ``fn``'s return value comes back, pickled, so ``fn`` returns everything the
caller needs (the Trainer returns its `RankZeroResults`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accord.environments.cluster_environment import ClusterEnvironment

__all__ = ["Launcher", "rank_environment", "threads_per_process"]


class Launcher(ABC):
    """Starts the local ranks, runs ``fn`` on each, and returns local rank zero's result."""

    @property
    def is_interactive_compatible(self) -> bool:
        """Whether it works from a notebook or a REPL (no script to re-run)."""
        return False

    @property
    def runs_in_caller(self) -> bool:
        """Whether the process that calls `launch` is local rank zero and runs ``fn`` itself.

        True (the default) when the caller takes part, so what ``fn`` changes in its
        objects stays. False when every rank is a new process and the caller only waits:
        then only ``fn``'s return value on local rank zero comes back (pickled).
        """
        return True

    @abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on every local rank; return local rank zero's result.

        Raises:
            RankFailureError: a rank failed; the message names the rank that caused it.
        """


def threads_per_process(processes: int) -> int:
    """Each local process's share of the cores, so N processes do not oversubscribe them.

    An ``OMP_NUM_THREADS`` the user set wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def rank_environment(
    cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, port: str
) -> dict[str, str]:
    """The variables every local rank a launcher starts shares: rendezvous, world, threads.

    Each rank adds its own ``LOCAL_RANK``.
    """
    return {
        "MASTER_ADDR": cluster_environment.main_address,
        "MASTER_PORT": port,
        "NODE_RANK": str(cluster_environment.node_rank()),
        "WORLD_SIZE": str(num_processes * num_nodes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "OMP_NUM_THREADS": str(threads_per_process(num_processes)),
    }
