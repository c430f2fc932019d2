"""Run a function in real processes, one per rank, and collect what each returns.

This is how accord's own tests (and the conformance suite) exercise multi-rank code:
real processes started with ``spawn``, a real rendezvous on loopback, and a clear error
naming the rank that failed instead of a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from accord.environments.local import LocalEnvironment, find_free_port
from accord.errors import RankFailureError
from accord.launchers.launcher import rank_environment

__all__ = ["run_distributed"]

_GRACE_SECONDS = 5.0


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    import torch

    # Each rank gets its share of the cores, as torchrun does with OMP_NUM_THREADS=1.
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    # Plain pickle copies tensors; multiprocessing's pickler would pass shared-memory file
    # descriptors that disappear when this process exits.
    conn.send(("ok", pickle.dumps(result)))
    conn.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Each process has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (loopback)
    and a free ``MASTER_PORT`` set, so ``TorchCollective().setup()`` forms the group.
    ``fn`` and its arguments must be picklable (a module-level function).

    Returns:
        What each rank returned, in rank order.

    Raises:
        RankFailureError: a rank raised, died, or the run outlasted ``timeout`` seconds;
            the message names the rank and carries its traceback. The other ranks are
            stopped, so no process outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    ctx = multiprocessing.get_context("spawn")
    # One node on loopback, each rank with its share of the cores, as the launchers do.
    shared = rank_environment(LocalEnvironment(), world_size, 1, str(find_free_port()))
    child_env = {**shared, **(env or {})}
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, child_env, args, child_conn),
            name=f"accord-rank-{rank}",
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)
    try:
        return _collect(procs, conns, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _collect(procs: list[Any], conns: list[Connection], timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = {conn: rank for rank, conn in enumerate(conns)}
    while pending:
        remaining = deadline - time.monotonic()
        if errors:
            # Once a rank failed, the others get a short grace period to report theirs.
            remaining = min(remaining, _GRACE_SECONDS)
        if remaining <= 0:
            break
        for ready in wait(list(pending), timeout=remaining):
            conn = cast(Connection, ready)
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                procs[rank].join(1)
                errors[rank] = f"process exited with code {procs[rank].exitcode} before reporting"
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    if errors:
        # The first rank to report is the cause; later ones mostly saw it disappear.
        first = next(iter(errors))
        others = sorted(set(errors) - {first})
        also = f" (ranks {others} failed too)" if others else ""
        raise RankFailureError(f"Rank {first} failed{also}:\n{errors[first]}")
    if pending:
        missing = sorted(pending.values())
        raise RankFailureError(
            f"Ranks {missing} did not finish within {timeout:.0f} s; they were stopped. "
            "A rank that waits forever usually means the ranks called different collectives."
        )
    return [results[rank] for rank in range(len(procs))]
