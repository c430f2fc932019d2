"""`Launcher`: starts the processes a strategy needs and runs the work in each.

The contract: `Launcher.launch` runs ``fn`` on every local rank and returns what it
returned on local rank zero. Whether the caller's own objects see the work depends on
`Launcher.runs_in_caller`: when the calling process is local rank zero (the script is
re-run for the other ranks), they do; when every rank is a new process (spawn, fork,
XLA), only ``fn``'s return value comes back, pickled, so ``fn`` returns everything the
caller needs (the Trainer returns its `RankZeroResults`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from accord.core.env_vars import env_number

if TYPE_CHECKING:
    from accord.environments.cluster_environment import ClusterEnvironment

__all__ = [
    "FORWARDED_SIGNALS",
    "Launcher",
    "SignalForwarder",
    "rank_environment",
    "threads_per_process",
]

FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Signals a launcher passes on to the ranks it started, so a signal to the launcher
reaches every rank (where a fit turns it into a preemption checkpoint). SIGINT is not
among them: Ctrl+C in a terminal reaches every process of the job already, and a rank
zero interrupted alone stops the others through the launcher's failure handling."""


PARENT_ENV = "ACCORD_PARENT_PID"
"""Set in the ranks accord's own ``ddp`` launcher starts: the process id of the launching
process (the children exit when it is gone)."""


class Launcher(ABC):
    """Starts the local ranks, runs ``fn`` on each, and returns local rank zero's result."""

    survive_rank_loss: bool = False
    """When True, a rank that dies does not stop the others: the run goes on without it
    (``Trainer(on_rank_loss="continue")`` sets it for a fit)."""

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
    default = (os.cpu_count() or 1) // max(1, processes)
    return max(1, env_number("OMP_NUM_THREADS", int, default))


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


class SignalForwarder:
    """While installed, passes `FORWARDED_SIGNALS` this process receives on to ``pids()``.

    Then it calls the handler it replaced when that was a Python function; the default
    action (ending the launcher) is left to the ranks' own exit. Only the process that
    installed it forwards: a forked rank that inherited the handler does nothing with it.

    Args:
        pids: the processes to forward to (called in the handler; keep it cheap).
    """

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self._owner = os.getpid()
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> bool:
        """Start forwarding (main thread only); whether the handlers were installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._owner = os.getpid()
        for sig in FORWARDED_SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._forward)
        return True

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):  # that rank has ended already
                os.kill(pid, signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)
