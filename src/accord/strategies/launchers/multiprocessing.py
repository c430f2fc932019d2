"""`MultiprocessingLauncher`: start every local rank with ``spawn`` or ``fork``.

The launching process does not train; it waits for the ranks, and then takes rank zero's
results (trained weights, callback state, metrics) back into its own objects, so after
``trainer.fit(model)`` the caller's ``model`` holds the trained weights.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, cast

from typing_extensions import override

from accord.environments.cluster_environment import ClusterEnvironment
from accord.environments.local import find_free_port
from accord.errors import ConfigurationError, RankFailureError
from accord.strategies.launchers.launcher import Launcher, threads_per_process

__all__ = ["MultiprocessingLauncher", "RankZeroResults"]

_START_METHODS = ("spawn", "fork", "forkserver")


class RankZeroResults(Protocol):
    """What the launched function's owner (the Trainer) provides to move results home."""

    def _rank_zero_payload(self) -> Any:
        """Called on rank zero after the work: what to send to the launching process."""

    def _apply_rank_zero_payload(self, payload: Any) -> None:
        """Called in the launching process with what rank zero sent."""


def _worker(local_rank: int, env: dict[str, str], work: Any, conn: Connection) -> None:
    os.environ.update(env, LOCAL_RANK=str(local_rank))
    import torch

    if isinstance(work, bytes):
        work = pickle.loads(work)
    fn, args, kwargs, owner = work

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        result = fn(*args, **kwargs)
        payload = owner._rank_zero_payload() if owner is not None and local_rank == 0 else None
        # Plain pickle copies tensor data; torch's shared-memory reduction would hand over
        # file descriptors that vanish when this process exits.
        body = pickle.dumps((result, payload)) if local_rank == 0 else None
        conn.send(("ok", body))
    except BaseException as err:
        conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
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
        owner: the object whose `_rank_zero_payload` / `_apply_rank_zero_payload` move
            rank zero's results back (the Trainer).
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
        self.owner: RankZeroResults | None = None

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.start_method == "fork"

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.start_method == "fork":
            _refuse_fork_after_cuda()
        env = self.cluster_environment
        port = os.environ.get("MASTER_PORT") or str(find_free_port(env.main_address))
        shared = {
            "MASTER_ADDR": env.main_address,
            "MASTER_PORT": port,
            "NODE_RANK": str(env.node_rank()),
            "WORLD_SIZE": str(self.num_processes * self.num_nodes),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "OMP_NUM_THREADS": str(threads_per_process(self.num_processes)),
        }
        ctx = multiprocessing.get_context(self.start_method)
        work: Any = (fn, args, kwargs, self.owner)
        if self.start_method != "fork":
            # Plain pickle gives every rank its own copy of the model. multiprocessing's
            # own pickler would move tensors to shared memory, and all ranks would then
            # update the same parameters.
            work = pickle.dumps(work)
        procs, conns = [], []
        for local_rank in range(self.num_processes):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_worker,
                args=(local_rank, shared, work, sender),
                name=f"accord-rank-{local_rank}",
            )
            proc.start()
            sender.close()
            procs.append(proc)
            conns.append(receiver)
        try:
            result, payload = self._collect(procs, conns)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        if self.owner is not None:
            self.owner._apply_rank_zero_payload(payload)
        return result

    def _collect(self, procs: list[Any], conns: list[Connection]) -> tuple[Any, Any]:
        pending = dict(enumerate(conns))
        errors: dict[int, str] = {}
        rank_zero: tuple[Any, Any] = (None, None)
        deadline: float | None = None
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
                    status, body = conn.recv()
                except EOFError:
                    procs[local_rank].join(1)
                    code = procs[local_rank].exitcode
                    errors[local_rank] = f"process died (exit code {code}) before reporting"
                else:
                    if status == "ok":
                        if local_rank == 0:
                            rank_zero = pickle.loads(body)
                    else:
                        errors[local_rank] = body
                if errors and deadline is None:
                    # One rank failed; the rest get a short grace period, then are stopped.
                    deadline = time.monotonic() + self.failure_grace
        if errors:
            # The first rank to report is the cause; later ones mostly saw it disappear.
            first = next(iter(errors))
            others = sorted(set(errors) - {first})
            also = f" (local ranks {others} failed too)" if others else ""
            stopped = sorted(pending)
            note = f"; local ranks {stopped} were stopped" if stopped else ""
            raise RankFailureError(f"Local rank {first} failed{also}{note}:\n{errors[first]}")
        return rank_zero


def _refuse_fork_after_cuda() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise ConfigurationError(
            "CUDA was already initialised in this process, so forked ranks cannot use it. "
            "Use strategy='ddp_spawn', or avoid touching CUDA before trainer.fit()."
        )
