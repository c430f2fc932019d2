"""`SubprocessScriptLauncher`: re-run the user's script once per extra local rank.

The process the user started becomes local rank 0; ranks 1..N-1 run the same command line
with ``LOCAL_RANK`` and the rendezvous variables set, reach the same ``Trainer.fit`` call,
and join the group. A watcher thread ends the whole job when any rank dies, so a crash on
one rank never leaves the others waiting; a child whose parent died exits too.
"""

from __future__ import annotations

import _thread
import atexit
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing_extensions import override

from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError, RankFailureError
from accord.strategies.launchers.launcher import Launcher, threads_per_process

__all__ = ["SubprocessScriptLauncher"]

_PARENT_ENV = "ACCORD_PARENT_PID"
_POLL_SECONDS = 0.2


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

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.cluster_environment.creates_processes_externally:
            _watch_parent()
            return fn(*args, **kwargs)
        self._start_children()
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            failed = self._failed_child()
            # Rank 0 failed: the children would wait for it in a collective; stop them now.
            self.kill()
            if failed is not None and not isinstance(err, KeyboardInterrupt):
                local_rank, code = failed
                raise RankFailureError(
                    f"local rank {local_rank} exited with code {code} (its traceback is printed "
                    f"above), so rank 0 stopped too: {type(err).__name__}: {err}"
                ) from err
            raise

    def _failed_child(self, wait: float = 2.0) -> tuple[int, int] | None:
        """The first child that exited with an error, waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            for local_rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code not in (None, 0):
                    return local_rank, int(code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_SECONDS / 4)

    def kill(self) -> None:
        """Stop every child this launcher started."""
        for child in self.children:
            if child.poll() is None:
                child.kill()

    def _start_children(self) -> None:
        command = _script_command()
        env = self.cluster_environment
        threads = threads_per_process(self.num_processes)
        shared = {
            "MASTER_ADDR": env.main_address,
            "MASTER_PORT": str(env.main_port),
            "NODE_RANK": str(env.node_rank()),
            "WORLD_SIZE": str(self.num_processes * self.num_nodes),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "OMP_NUM_THREADS": str(threads),
        }
        # This process is local rank 0; later fits in the same script must not launch again,
        # because the children run the whole script, those fits included.
        os.environ.update(shared, LOCAL_RANK="0")
        import torch

        torch.set_num_threads(threads)
        for local_rank in range(1, self.num_processes):
            child_env = {
                **os.environ,
                **shared,
                "LOCAL_RANK": str(local_rank),
                _PARENT_ENV: str(os.getpid()),
            }
            self.children.append(subprocess.Popen(command, env=child_env))
        atexit.register(self._reap)
        watcher = threading.Thread(target=self._watch_children, name="accord-watcher", daemon=True)
        watcher.start()

    def _watch_children(self) -> None:
        while True:
            for local_rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code not in (None, 0):
                    self._fail(local_rank, code)
                    return
            if all(child.poll() == 0 for child in self.children):
                return
            time.sleep(_POLL_SECONDS)

    def _fail(self, local_rank: int, code: int) -> None:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(
            f"[accord] local rank {local_rank} {how}; stopping the other ranks "
            "(its traceback, if it raised, is printed above).",
            file=sys.stderr,
            flush=True,
        )
        self.kill()
        # Interrupt rank 0's main thread; if it is stuck inside a collective, exit hard.
        _thread.interrupt_main()
        deadline = time.monotonic() + self.failure_grace
        while time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        os._exit(1)

    def _reap(self) -> None:
        deadline = time.monotonic() + self.failure_grace
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


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
