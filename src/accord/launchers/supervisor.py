"""`supervise`: a rank's work in a forked child, so the rank's loss is not its process's.

Under torchrun, the agent watches the processes it started, and when one of them fails it
stops all the others (and restarts them all, if restarts are left): a lost rank would end
every survivor. With ``Trainer(on_rank_loss="continue")`` each of those processes instead
forks the rank's training into a child and watches it. When the child is killed, crashes
or is left out by the others, this process notes it on the agent's store (the survivors
read it when they regroup) and leaves quietly with status 0, so the agent keeps the
others running; the survivors train on and finish the run. Signals this process gets
(torchrun's SIGTERM, a preemption) are passed on to the child. The child's result comes
back pickled, as under ``ddp_spawn``.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from typing import Any

from typing_extensions import override

from accord.core.regroup import Excluded
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import EXCLUDED_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted, RankFailureError
from accord.launchers.launcher import PARENT_ENV, Launcher, SignalForwarder
from accord.launchers.loss_notes import LossNotes, cause_of

__all__ = ["SupervisingLauncher", "supervise"]

_log = logging.getLogger(__name__)


class SupervisingLauncher(Launcher):
    """The launcher of a rank something else started (torchrun, SLURM) in a run that goes
    on without lost ranks: the work runs in a forked child (`supervise`).

    Args:
        cluster_environment: where the rendezvous store is served, for the notes on a loss.
    """

    def __init__(self, cluster_environment: ClusterEnvironment) -> None:
        self.cluster_environment = cluster_environment

    @classmethod
    def wanted(cls, cluster_environment: ClusterEnvironment | None) -> bool:
        """Whether a rank in ``cluster_environment`` needs one: something other than
        accord started it, and this platform can fork."""
        return (
            cluster_environment is not None
            and cluster_environment.creates_processes_externally
            and PARENT_ENV not in os.environ
            and hasattr(os, "fork")
        )

    @property
    @override
    def runs_in_caller(self) -> bool:
        return False

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return supervise(fn, args, kwargs, self.cluster_environment)


def supervise(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], env: ClusterEnvironment
) -> Any:
    """Run ``fn(*args, **kwargs)`` in a forked child and return what it returned.

    Raises:
        SystemExit: status 0, when the child was lost and the others go on without it.
        Preempted: the child stopped for a preemption.
        BaseException: the child's own error.
    """
    receiver, sender = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # the child: this rank's training
        receiver.close()
        _run_child(fn, args, kwargs, sender)
    sender.close()
    forwarder = SignalForwarder(lambda: [pid])
    forwarder.install()
    try:
        try:
            message = receiver.recv()
        except EOFError:
            message = None
    finally:
        forwarder.restore()
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if message is None or message[0] == "excluded":
        member = env.global_rank()
        cause = "left out by the others" if message else cause_of(code)
        _log.warning("rank %d's training ended (%s); the others go on without it.", member, cause)
        if message is None:
            LossNotes(env).lost(member, code)
        raise SystemExit(0)
    kind, body = message
    if kind == "ok":
        return pickle.loads(body)
    if kind == "preempted":
        raise Preempted(*body)
    error = pickle.loads(body)
    if isinstance(error, BaseException):
        raise error
    raise RankFailureError(str(error))


def _run_child(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sender: Connection
) -> None:
    """In the child: run the work, send its outcome, and exit (never return)."""
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    code = 0
    try:
        message: tuple[str, Any] = ("ok", pickle.dumps(fn(*args, **kwargs)))
    except Preempted as stop:
        message, code = (
            ("preempted", (stop.checkpoint, stop.step, stop.signal_name)),
            PREEMPTED_EXIT_CODE,
        )
    except Excluded:
        message, code = ("excluded", None), EXCLUDED_EXIT_CODE
    except BaseException as err:
        code = 1
        try:
            message = ("error", pickle.dumps(err))
        except Exception:
            text = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            message = ("error", pickle.dumps(text))
    try:
        sender.send(message)
        sender.close()
    finally:
        os._exit(code)  # the work is done: nothing of the parent's may run here


def _exit_with_parent(parent: int) -> None:
    """End the child when the process that forked it is gone, so no rank is orphaned."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
