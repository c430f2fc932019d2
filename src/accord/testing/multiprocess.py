"""Run a function in real processes, one per rank, and collect what each returns.

This is how accord's own tests (and the conformance suite) exercise multi-rank code:
real processes, a real rendezvous on loopback, and a clear error naming the rank that
failed instead of a hang. The processes start with ``spawn`` (fresh interpreters), or
from a fork server that imported torch and accord once (`set_start_method`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, cast

from accord.environments.local import LocalEnvironment, find_free_port
from accord.errors import RankFailureError
from accord.launchers.launcher import rank_environment

__all__ = ["StartMethod", "run_distributed", "set_start_method"]

StartMethod = Literal["spawn", "forkserver"]
"""How `run_distributed` starts the rank processes (see `set_start_method`)."""

_GRACE_SECONDS = 5.0
# What the fork server imports before it forks the first rank: what every rank needs.
_SERVER_IMPORTS = ("torch", "torch.distributed", "accord", "accord.testing")
_start_method: StartMethod = "spawn"
_preload: tuple[str, ...] = ()


def set_start_method(method: StartMethod, *, preload: Sequence[str] = ()) -> None:
    """Choose how `run_distributed` starts rank processes in this process from now on.

    It applies to every later call without its own ``start_method``, the conformance
    suite's and `assert_strategies_agree`'s included.

    - ``"spawn"`` (the default): each rank is a fresh interpreter, which imports torch,
      accord and the module of the function before it runs (a second or more per rank).
    - ``"forkserver"``: the ranks are forked from multiprocessing's fork server, a process
      started once that imports torch, accord and ``preload`` before it forks any rank;
      each rank still imports the module of the function, and starts in a fraction of the
      time. Such a rank gets the caller's environment, working directory and ``sys.path``
      at the call, like a spawned one; but it leaves with ``os._exit``, without running
      ``atexit`` handlers, and modules read their import-time settings (environment
      variables included) when the server imported them.

    A test suite that starts many small multi-rank runs calls it once, in a
    ``conftest.py``.

    Args:
        method: ``"spawn"`` or ``"forkserver"``.
        preload: further modules the fork server imports (say, the module of the suite's
            models). They apply when the server starts: at the first ``"forkserver"`` run
            of this process. accord sets multiprocessing's fork-server preload list,
            replacing one set with `multiprocessing.set_forkserver_preload`.

    Raises:
        ValueError: ``method`` is neither ``"spawn"`` nor ``"forkserver"``.
    """
    global _start_method, _preload
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"method must be 'spawn' or 'forkserver', got {method!r}.")
    _start_method, _preload = method, tuple(preload)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    # The caller's whole environment: a forked rank would otherwise keep the fork server's.
    os.environ.clear()
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


def _context(method: StartMethod) -> Any:
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the server starts, at the first forkserver run.
        ctx.set_forkserver_preload([*_SERVER_IMPORTS, *_preload])
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    start_method: StartMethod | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Each process has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (loopback)
    and a free ``MASTER_PORT`` set, so ``TorchCollective().setup()`` forms the group.
    ``fn`` and its arguments must be picklable (a module-level function).

    Args:
        fn: the function each rank calls.
        world_size: the number of ranks.
        *args: further arguments of ``fn``, after the rank and the world size.
        timeout: seconds the ranks get, together, before they are stopped.
        env: environment variables set in every rank, over this process's environment.
        start_method: ``"spawn"`` or ``"forkserver"``; by default the one chosen with
            `set_start_method` (``"spawn"`` unless changed).

    Returns:
        What each rank returned, in rank order.

    Raises:
        RankFailureError: a rank raised, died, or the run outlasted ``timeout`` seconds;
            the message names the rank and carries its traceback. The other ranks are
            stopped, so no process outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    ctx = _context(start_method or _start_method)
    # One node on loopback, each rank with its share of the cores, as the launchers do.
    shared = rank_environment(LocalEnvironment(), world_size, 1, str(find_free_port()))
    child_env = {**os.environ, **shared, **(env or {})}
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
