"""`MultiprocessingLauncher`: start every local rank with ``spawn`` or ``fork``.

The launching process does not train: it waits for the ranks, and `launch` returns what
the work returned on local rank zero, pickled. The Trainer's work returns its
`RankZeroResults` (trained weights, callback state, metrics), which the Trainer then
applies to its own objects, so after ``trainer.fit(model)`` the caller's ``model`` holds
the trained weights. Signals sent to the launching process (`FORWARDED_SIGNALS`) are
passed on to the ranks; when the ranks stop for a preemption, `launch` raises `Preempted`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from typing_extensions import override

from accord.core.regroup import Excluded
from accord.core.rendezvous import LAUNCHER_STORE_ENV_VAR, serve_store
from accord.environments.cluster_environment import ClusterEnvironment
from accord.environments.local import find_free_port
from accord.errors import (
    EXCLUDED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    ConfigurationError,
    Preempted,
    RankFailureError,
    is_communication_error,
)
from accord.launchers.launcher import (
    FORWARDED_SIGNALS,
    Launcher,
    SignalForwarder,
    rank_environment,
)
from accord.launchers.loss_notes import LossNotes, cause_of
from accord.launchers.unpicklable import unpicklable_message

__all__ = ["MultiprocessingLauncher"]

_START_METHODS = ("spawn", "fork", "forkserver")
_POLL_SECONDS = 0.2
_log = logging.getLogger(__name__)


def _worker(
    local_rank: int, env: dict[str, str], work: Any, conn: Connection, report_all: bool
) -> None:
    os.environ.update(env, LOCAL_RANK=str(local_rank))
    # A forked rank inherits the launcher's forwarding handlers; a rank has its own.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    import torch

    if isinstance(work, bytes):
        work = pickle.loads(work)
    fn, args, kwargs = work

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        result = fn(*args, **kwargs)
        # Plain pickle copies tensor data; torch's shared-memory reduction would hand over
        # file descriptors that vanish when this process exits.
        body = pickle.dumps(result) if local_rank == 0 or report_all else None
        conn.send(("ok", body, False, ()))
    except Preempted as stop:
        conn.send(("preempted", (stop.checkpoint, stop.step, stop.signal_name), False, ()))
        raise SystemExit(PREEMPTED_EXIT_CODE) from None
    except Excluded:
        conn.send(("excluded", None, False, ()))
        raise SystemExit(EXCLUDED_EXIT_CODE) from None
    except BaseException as err:
        # Classified here, where the exception object still exists: the launcher only gets
        # text, and must tell a rank that lost its peer from the rank that failed first.
        text = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        lost = err.ranks if isinstance(err, RankFailureError) else ()
        conn.send(("error", text, is_communication_error(err), tuple(lost)))
        raise SystemExit(1) from None
    finally:
        conn.close()


class MultiprocessingLauncher(Launcher):
    """Start ``num_processes`` local ranks with ``start_method`` and wait for them.

    Args:
        cluster_environment: supplies the main address and port.
        num_processes: processes on this node.
        start_method: ``"spawn"`` (everything passed must pickle) or ``"fork"`` (works
            from notebooks; not after CUDA was initialised).
        num_nodes: nodes in the job.
        failure_grace: seconds the other ranks get to stop after one failed.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        start_method: str = "spawn",
        num_nodes: int = 1,
        failure_grace: float = 10.0,
    ) -> None:
        if start_method not in _START_METHODS:
            raise ConfigurationError(
                f"start_method={start_method!r} is not one of {_START_METHODS}."
            )
        if start_method not in multiprocessing.get_all_start_methods():
            raise ConfigurationError(
                f"start_method={start_method!r} is not available on this platform; use 'spawn'."
            )
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.start_method = start_method
        self.num_nodes = num_nodes
        self.failure_grace = failure_grace

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.start_method == "fork"

    @property
    @override
    def runs_in_caller(self) -> bool:
        return False

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.start_method == "fork":
            _refuse_fork_after_cuda()
        env = self.cluster_environment
        port = os.environ.get("MASTER_PORT") or str(find_free_port(env.main_address))
        shared = rank_environment(env, self.num_processes, self.num_nodes, port)
        store = None
        if self.survive_rank_loss:
            # The store must outlive any rank, rank 0 included: this process serves it.
            shared[LAUNCHER_STORE_ENV_VAR] = "1"
            if env.node_rank() == 0:
                store = serve_store(env.main_address, int(port))
        ctx = multiprocessing.get_context(self.start_method)
        work: Any = (fn, args, kwargs)
        if self.start_method != "fork":
            # Plain pickle gives every rank its own copy of the model. multiprocessing's
            # own pickler would move tensors to shared memory, and all ranks would then
            # update the same parameters.
            try:
                work = pickle.dumps(work)
            except (pickle.PicklingError, AttributeError, TypeError) as err:
                message = unpicklable_message(self.start_method, fn, args, kwargs, err)
                raise ConfigurationError(message) from err
        procs, conns = [], []
        for local_rank in range(self.num_processes):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_worker,
                args=(local_rank, shared, work, sender, self.survive_rank_loss),
                name=f"accord-rank-{local_rank}",
            )
            proc.start()
            sender.close()
            procs.append(proc)
            conns.append(receiver)
        forwarder = SignalForwarder(lambda: [p.pid for p in procs if p.is_alive()])
        forwarder.install()
        try:
            if self.survive_rank_loss:
                return self._collect_surviving(procs, conns, LossNotes(env, store))
            return self._collect(procs, conns)
        finally:
            forwarder.restore()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()

    def _collect(self, procs: list[Any], conns: list[Connection]) -> Any:
        pending = dict(enumerate(conns))
        errors: dict[int, _Failure] = {}
        rank_zero: Any = None
        preempted: tuple[str, int, str] | None = None
        deadline: float | None = None
        first = self.cluster_environment.node_rank() * self.num_processes
        lost: set[int] = set()  # local ranks another rank found dead or frozen
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if deadline is not None and timeout == 0.0:
                break
            ready = wait(list(pending.values()), timeout=timeout)
            for item in ready:
                conn = cast(Connection, item)
                local_rank = next(r for r, c in pending.items() if c is conn)
                del pending[local_rank]
                try:
                    status, body, communication, ranks = conn.recv()
                except EOFError:
                    procs[local_rank].join(1)
                    errors[local_rank] = _died(local_rank, procs[local_rank].exitcode)
                else:
                    if status == "ok":
                        if local_rank == 0:
                            rank_zero = pickle.loads(body)
                    elif status == "preempted":
                        preempted = preempted or body
                    else:
                        errors[local_rank] = _Failure(local_rank, body, communication=communication)
                        lost.update(r - first for r in ranks)
                if errors and deadline is None:
                    # One rank failed; the rest get a short grace period, then are stopped.
                    deadline = time.monotonic() + self.failure_grace
            if pending and set(pending) <= lost:
                # Those left stopped answering (dead or frozen): no use waiting for them.
                for local_rank in pending:
                    errors[local_rank] = _froze(local_rank)
                pending.clear()
        if errors:
            raise RankFailureError(_failure_report(list(errors.values()), sorted(pending)))
        if preempted is not None:
            raise Preempted(*preempted)
        return rank_zero

    def _collect_surviving(
        self, procs: list[Any], conns: list[Connection], notes: LossNotes
    ) -> Any:
        """`_collect` for a run that goes on without a lost rank: a rank that dies is
        noted (`LossNotes`) and waited for no more, one the others left out is stopped;
        the result is the lowest surviving local rank's. A rank that fails with an error
        of its own still ends the run."""
        pending = dict(enumerate(conns))
        results: dict[int, bytes] = {}
        errors: dict[int, _Failure] = {}
        preempted: tuple[str, int, str] | None = None
        first = self.cluster_environment.node_rank() * self.num_processes
        while pending and not errors:
            for item in wait(list(pending.values()), timeout=_POLL_SECONDS):
                conn = cast(Connection, item)
                local_rank = next(r for r, c in pending.items() if c is conn)
                del pending[local_rank]
                try:
                    status, body, communication, _ = conn.recv()
                except EOFError:
                    procs[local_rank].join(1)
                    code = procs[local_rank].exitcode
                    code = -signal.SIGKILL if code is None else code
                    _log.warning(
                        "local rank %d (rank %d) ended (%s); the others go on without it.",
                        local_rank,
                        first + local_rank,
                        cause_of(code),
                    )
                    notes.lost(first + local_rank, code)
                    continue
                if status == "ok":
                    results[local_rank] = body
                elif status == "preempted":
                    preempted = preempted or body
                elif status != "excluded":
                    errors[local_rank] = _Failure(local_rank, body, communication=communication)
            for local_rank in [r for r in pending if notes.left(first + r)]:
                procs[local_rank].kill()
                procs[local_rank].join()
                del pending[local_rank]
        if errors:
            raise RankFailureError(_failure_report(list(errors.values()), sorted(pending)))
        if preempted is not None:
            raise Preempted(*preempted)
        if not results:
            raise RankFailureError("Every rank was lost: no rank finished the run.")
        return pickle.loads(results[min(results)])


@dataclass(frozen=True)
class _Failure:
    """How one rank failed: ``text`` is its report (or what the launcher saw)."""

    local_rank: int
    text: str
    died: bool = False
    communication: bool = False

    @property
    def summary(self) -> str:
        return self.text.split("\n", 1)[0]


def _died(local_rank: int, code: int | None) -> _Failure:
    if code is not None and code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        how = f"was killed by signal {-code}{name}"
    else:
        how = "died"
    return _Failure(local_rank, f"process {how} before reporting (exit code {code})", died=True)


def _froze(local_rank: int) -> _Failure:
    return _Failure(
        local_rank,
        "its heartbeat stood still (the process froze or hung): stopped by the launcher",
        died=True,
    )


def _failure_report(failures: list[_Failure], stopped: list[int]) -> str:
    """Name the root cause first, then what followed from it.

    The first rank to report is often not the cause: a rank that lost its peer reports at
    once, while the peer that was killed only shows up when its pipe closes. So a rank that
    died without reporting wins, then one that raised an error of its own, then one that
    only lost contact; among equals, the first to report.
    """
    cause = min(failures, key=lambda f: (not f.died, f.communication))
    rest = [f for f in failures if f is not cause]
    lines = [f"Local rank {cause.local_rank} failed:", cause.text.rstrip()]
    consequences = [f for f in rest if f.communication]
    if consequences:
        lines.append("Consequences (these ranks lost contact with a failed rank):")
        lines += [f"  local rank {f.local_rank}: {f.summary}" for f in consequences]
    others = [f for f in rest if not f.communication]
    if others:
        lines.append("Also failed:")
        lines += [f"  local rank {f.local_rank}: {f.summary}" for f in others]
    if stopped:
        lines.append(f"Local ranks {stopped} were stopped after the grace period.")
    return "\n".join(lines)


def _refuse_fork_after_cuda() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise ConfigurationError(
            "CUDA was already initialised in this process, so forked ranks cannot use it. "
            "Use strategy='ddp_spawn', or avoid touching CUDA before trainer.fit()."
        )
