"""`SubprocessScriptLauncher`: re-run the user's script once per extra local rank.

The process the user started becomes local rank 0; ranks 1..N-1 run the same command line
with ``LOCAL_RANK`` and the rendezvous variables set, reach the same ``Trainer.fit`` call,
and join the group. A watcher thread ends the whole job when any rank dies, so a crash on
one rank never leaves the others waiting; a child whose parent died exits too. Signals
sent to this process (`FORWARDED_SIGNALS`) are passed on to the children while the work
runs, and a child that exits with `PREEMPTED_EXIT_CODE` stopped for a preemption, not a
failure.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing_extensions import override

from accord.core.regroup import REJOIN_ENV_VAR
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import (
    EXCLUDED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    CollectiveMismatchError,
    ConfigurationError,
    NonFiniteValueError,
    Preempted,
    RankFailureError,
    is_communication_error,
)
from accord.launchers.launcher import PARENT_ENV, Launcher, SignalForwarder, rank_environment
from accord.launchers.loss_notes import LossNotes
from accord.launchers.lost_children import LostChildren, how_it_ended, is_stopped

__all__ = ["SubprocessScriptLauncher"]

_log = logging.getLogger(__name__)

_PARENT_ENV = PARENT_ENV
_POLL_SECONDS = 0.2
# How a child may end without failing the run: done, stopped for a preemption, or left
# out of its group by the others (on_rank_loss="continue").
_FINE = (0, PREEMPTED_EXIT_CODE, EXCLUDED_EXIT_CODE)


class SubprocessScriptLauncher(Launcher):
    """Start local ranks 1..N-1 as copies of this script; this process is local rank 0.

    Args:
        cluster_environment: supplies the main address and port.
        num_processes: processes on this node.
        num_nodes: nodes in the job (each node runs the same command with its ``NODE_RANK``).
        failure_grace: seconds the surviving ranks get to stop after one rank failed,
            before they are killed.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int = 1,
        failure_grace: float = 10.0,
    ) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.failure_grace = failure_grace
        self.children: list[subprocess.Popen[bytes]] = []
        # Shared with the watcher thread: the first child failure (local rank, exit code),
        # and whether the main thread has taken over handling a failure.
        self._lock = threading.Lock()
        self._failure: tuple[int, int] | None = None
        self._handling = False
        self._handled = threading.Event()
        # The children lost while the run went on without them, and their replacements.
        self._losses = LostChildren(self._member)
        self._command: list[str] = []

    def _member(self, local_rank: int) -> int:
        return self.cluster_environment.node_rank() * self.num_processes + local_rank

    def _restarted(self, local_rank: int) -> subprocess.Popen[bytes]:
        """A replacement for the lost local rank ``local_rank``."""
        return subprocess.Popen(self._command, env=self._child_env(local_rank, True))

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.cluster_environment.creates_processes_externally and not self.children:
            _watch_parent()
            return fn(*args, **kwargs)
        # Later fits in this script run on the children started by the first one.
        if not self.children:
            self._start_children()
        forwarder = SignalForwarder(self._live_children)
        forwarder.install()
        try:
            return self._run_rank_zero(fn, *args, **kwargs)
        finally:
            forwarder.restore()

    def _live_children(self) -> list[int]:
        return [child.pid for child in self.children if child.poll() is None]

    def _run_rank_zero(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return fn(*args, **kwargs)
            except (Preempted, NonFiniteValueError, CollectiveMismatchError):
                # Every rank stops with this in the same step: let the children finish
                # their own exit instead of killing them mid-save or mid-report (or while
                # they write their collective trace).
                self._stand_down()
                self._wait_for_children(self.failure_grace)
                self.kill()
                raise
            except BaseException as err:
                failure = self._take_over()
                if failure is None and is_communication_error(err):
                    # Rank 0 lost contact with a child: wait for the one that failed. One that
                    # raised may take seconds to exit on a busy machine, so the grace period.
                    failure = self._failed_child(self._exit_wait(err))
                # Rank 0 failed: the children would wait for it in a collective; stop them now.
                self.kill()
                if failure is None or _is_interrupt(err, failure):
                    raise  # rank 0's own error is the cause (or the user pressed Ctrl+C)
                raise RankFailureError(_report(failure, err)) from err
        except KeyboardInterrupt as interrupt:
            # The watcher's interrupt can land anywhere, the handler above included.
            failure = self._take_over()
            self.kill()
            if failure is None or _is_interrupt(interrupt, failure):
                raise
            raise RankFailureError(_report(failure, interrupt)) from interrupt

    def _take_over(self) -> tuple[int, int] | None:
        """From now on the main thread handles failures; return the child that failed first.

        The watcher no longer interrupts this thread or exits the process, and ignores the
        children that rank 0 stops itself. Only the first call looks at the children: by a
        later one, rank 0 may have killed them.
        """
        with self._lock:
            first = not self._handling
            self._handling = True
            self._handled.set()
            failure = self._failure
        if failure is None and first:
            failure = self._record(self._dead_child())
        return failure

    def _exit_wait(self, err: BaseException) -> float:
        """How long rank 0 waits for a child's exit to explain its communication error.

        When ``err`` names the ranks rank 0 found gone by their heartbeats, only a named
        child still running is worth waiting for: its heartbeat stops as it exits, before
        the process ends (on a busy machine, seconds before). One stopped by a signal is
        frozen, and one of another node is not this launcher's.
        """
        if not isinstance(err, RankFailureError) or not err.ranks:
            return self.failure_grace
        named = set(err.ranks)
        exiting = (
            self._member(local_rank) in named and child.poll() is None and not is_stopped(child.pid)
            for local_rank, child in enumerate(self.children, start=1)
        )
        return self.failure_grace if any(exiting) else 0.0

    def _failed_child(self, wait: float) -> tuple[int, int] | None:
        """The first child that exited with an error, waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            failure = self._dead_child()
            if failure is not None:
                return self._record(failure)
            if time.monotonic() >= deadline or all(c.poll() in _FINE for c in self.children):
                return None
            time.sleep(_POLL_SECONDS / 4)

    def _dead_child(self) -> tuple[int, int] | None:
        """A child that exited with an error, one killed by a signal first; None if none."""
        dead = []
        for local_rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None and code not in _FINE and local_rank not in self._losses.lost:
                dead.append((local_rank, int(code)))
        # A rank killed by a signal did not see anything go wrong: the others that exited
        # with an error most likely lost contact with it.
        return min(dead, key=lambda failure: (failure[1] >= 0, failure[0]), default=None)

    def _record(
        self, failure: tuple[int, int] | None, from_watcher: bool = False
    ) -> tuple[int, int] | None:
        """Keep the first failure seen (by either thread), announce it once, and return it.

        The watcher's is ignored (None) once the main thread handles a failure.
        """
        if failure is None:
            return None
        with self._lock:
            if from_watcher and self._handling:
                return None
            if self._failure is not None:
                return self._failure
            self._failure = failure
        local_rank, code = failure
        _log.error(
            "local rank %d %s; stopping the other ranks (its traceback, if it raised, is "
            "printed above).",
            local_rank,
            how_it_ended(code),
        )
        return failure

    def _stand_down(self) -> None:
        """The main thread handles the end of the run; the watcher no longer acts."""
        with self._lock:
            self._handling = True
            self._handled.set()

    def _wait_for_children(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for every child to exit."""
        deadline = time.monotonic() + wait
        while any(c.poll() is None for c in self.children) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS / 4)

    def kill(self) -> None:
        """Stop every child this launcher started."""
        for child in self.children:
            if child.poll() is None:
                child.kill()

    def _start_children(self) -> None:
        command = _script_command()
        env = self.cluster_environment
        shared = rank_environment(env, self.num_processes, self.num_nodes, str(env.main_port))
        # This process is local rank 0; later fits in the same script must not launch again,
        # because the children run the whole script, those fits included.
        os.environ.update(shared, LOCAL_RANK="0")
        import torch

        torch.set_num_threads(int(shared["OMP_NUM_THREADS"]))
        self._command = command
        for local_rank in range(1, self.num_processes):
            self.children.append(subprocess.Popen(command, env=self._child_env(local_rank)))
        atexit.register(self._reap)
        watcher = threading.Thread(target=self._watch_children, name="accord-watcher", daemon=True)
        watcher.start()

    def _child_env(self, local_rank: int, rejoin: bool = False) -> dict[str, str]:
        """The environment of local rank ``local_rank`` (``rejoin``: a replacement)."""
        env = {**os.environ, "LOCAL_RANK": str(local_rank), _PARENT_ENV: str(os.getpid())}
        if rejoin:
            env[REJOIN_ENV_VAR] = "1"
        return env

    def _watch_children(self) -> None:
        notes = LossNotes(self.cluster_environment) if self.survive_rank_loss else None
        while not self._handling:
            failure = self._dead_child()
            if failure is not None and notes is not None:
                self._losses.note(notes, *failure, self.max_restarts)
                continue
            if notes is not None:
                self._losses.stop_left(notes, self.children)
                self._losses.restart(notes, self.children, self._restarted, self.max_restarts)
            if failure is not None:
                self._fail(failure)
                return
            if not self._losses.to_restart and all(
                child.poll() in _FINE or local_rank in self._losses.lost
                for local_rank, child in enumerate(self.children, start=1)
            ):
                return
            time.sleep(_POLL_SECONDS)

    def _fail(self, failure: tuple[int, int]) -> None:
        if self._record(failure, from_watcher=True) is None:
            return  # rank 0 handles a failure already, and may have killed this child itself
        self.kill()
        # If rank 0 is stuck inside a collective and never reacts, exit hard.
        if self._interrupt_rank_zero() and not self._handled.wait(self.failure_grace):
            os._exit(1)

    def _interrupt_rank_zero(self) -> bool:
        """Interrupt the main thread, unless it handles a failure already; whether it did.

        Under the lock `_take_over` takes, so no interrupt arrives once rank 0 started
        handling its own error; the failure was recorded before, so an interrupt always
        finds what caused it.
        """
        with self._lock:
            if self._handling:
                return False
            _thread.interrupt_main()
            return True

    def _reap(self) -> None:
        """At exit: wait for the children (kill those still running after the grace
        period), and say which one ended badly after its work had succeeded."""
        with self._lock:
            reported = self._handling or self._failure is not None
            self._handling = True  # the watcher no longer acts: rank 0 is exiting
            self._handled.set()
        deadline = time.monotonic() + self.failure_grace
        for local_rank, child in enumerate(self.children, start=1):
            try:
                code = child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                if reported:
                    continue
                _log.warning(
                    "local rank %d was still running %g s after rank 0 finished; it was killed.",
                    local_rank,
                    self.failure_grace,
                )
                continue
            if not reported and code not in _FINE and local_rank not in self._losses.lost:
                _log.warning(
                    "local rank %d %s as it exited, after rank 0 had finished; its output "
                    "above says why.",
                    local_rank,
                    how_it_ended(code),
                )


def _report(failure: tuple[int, int], err: BaseException) -> str:
    """The child's failure as the cause, rank 0's ``err`` as its consequence."""
    local_rank, code = failure
    if isinstance(err, KeyboardInterrupt):
        consequence = "rank 0 was interrupted to stop."
    else:
        consequence = f"rank 0 stopped too: {type(err).__name__}: {err}"
    return (
        f"Local rank {local_rank} failed: it {how_it_ended(code)}; its traceback, if it raised, is "
        f"printed above. Consequence: {consequence}"
    )


def _is_interrupt(err: BaseException, failure: tuple[int, int]) -> bool:
    """Whether this is the user's Ctrl+C: rank 0 interrupted and a child ended by SIGINT too."""
    return isinstance(err, KeyboardInterrupt) and failure[1] == -signal.SIGINT


def _script_command() -> list[str]:
    """The command line that started this process, to run again for the other ranks."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        module = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script in ("-c", "-") or not Path(script).is_file():
        raise ConfigurationError(
            "strategy='ddp' re-runs your script for each extra process, but this process "
            "was not started from a script file (a notebook, `python -c`, or a REPL). Use "
            "strategy='ddp_notebook' (fork) or 'ddp_spawn' here, or run a script."
        )
    return [sys.executable, str(Path(script).resolve()), *sys.argv[1:]]


_watching_parent = False


def _watch_parent() -> None:
    """In a child: exit when the launching process is gone, so no rank is orphaned."""
    global _watching_parent
    parent = os.environ.get(_PARENT_ENV)
    if parent is None or _watching_parent:
        return
    _watching_parent = True
    parent_pid = int(parent)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_POLL_SECONDS * 5)

    threading.Thread(target=watch, name="accord-parent-watch", daemon=True).start()
