"""Where the ranks of a new torch.distributed group meet, and how long they wait for each other.

Rank 0 serves one TCP store per process and address; every group made on it gets a key
prefix of its own, so a second run in the same processes (fit, then test) never binds the
port again while the previous group's sockets close. Before the group is formed, the ranks
check in on the store and wait for each other at most `rendezvous_timeout()`: a node that
never starts ends in a `CollectiveTimeoutError` naming the missing ranks, not in a wait as
long as an op's timeout.

When the address is a loopback one (a single-machine job: `LocalEnvironment`'s default
``127.0.0.1``), rank 0 listens on that address only (`listen_on_loopback`), not on every
interface as torch's store does, and gloo listens on the loopback interface
(``GLOO_SOCKET_IFNAME``, unless it is set); other addresses keep torch's behaviour.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import socket
import time
from datetime import timedelta
from typing import Any

from accord.core.connections import GroupConnections
from accord.core.env_vars import env_number
from accord.errors import CollectiveError, CollectiveTimeoutError

__all__ = [
    "DEFAULT_RENDEZVOUS_TIMEOUT",
    "LAUNCHER_STORE_ENV_VAR",
    "launcher_serves_store",
    "serve_store",
    "attempt_prefix",
    "RENDEZVOUS_TIMEOUT_ENV_VAR",
    "init_group_on_prefix",
    "init_group_on_shared_store",
    "listen_on_loopback",
    "rendezvous_timeout",
]

DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
"""How long the ranks wait for each other when a group is created (torchrun's join timeout)."""

RENDEZVOUS_TIMEOUT_ENV_VAR = "ACCORD_RENDEZVOUS_TIMEOUT"
"""Seconds the ranks of a new group wait for each other; see `rendezvous_timeout`."""

_WAIT_LONGER = f"To wait longer, set {RENDEZVOUS_TIMEOUT_ENV_VAR} (seconds)."


def rendezvous_timeout() -> timedelta:
    """How long a new group waits for all its ranks: ``ACCORD_RENDEZVOUS_TIMEOUT`` seconds,
    else `DEFAULT_RENDEZVOUS_TIMEOUT`.

    Apart from the op timeout: a node that never starts must not keep the others waiting
    for the 30 minutes an op may take.

    Raises:
        ConfigurationError: the variable is not a positive number.
    """
    seconds = env_number(RENDEZVOUS_TIMEOUT_ENV_VAR, float, None, positive=True, unit="seconds")
    return DEFAULT_RENDEZVOUS_TIMEOUT if seconds is None else timedelta(seconds=seconds)


def listen_on_loopback(address: str, port: int) -> int | None:
    """A listening socket on ``address:port`` for a TCPStore's ``master_listen_fd``, when
    ``address`` is a loopback address or a name that resolves only to loopback addresses;
    None for any other address (the store then listens on every interface, torch's way).

    The caller owns the returned file descriptor; a TCPStore given it closes it. Port 0
    picks a free port (``TCPStore.port`` tells which).

    Raises:
        CollectiveError: the port is taken (or cannot be bound) on that address.
    """
    target = _loopback(address, port)
    if target is None:
        return None
    family, kind, proto, _, where = target
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
    except OSError as err:
        listener.close()
        raise CollectiveError(
            f"Could not listen on {where[0]}:{port} for the ranks' store: {err}. Another "
            "process uses that port: pick a free one (MASTER_PORT) or leave it unset."
        ) from err
    return listener.detach()


def _loopback(address: str, port: int) -> Any:
    """``address``'s getaddrinfo entry (IPv4 first) when it is loopback only, else None."""
    try:
        found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    loopback = [info for info in found if ipaddress.ip_address(info[4][0]).is_loopback]
    if not loopback or len(loopback) != len(found):
        return None
    # IPv4 first: torch's clients try every address a name resolves to.
    return min(loopback, key=lambda info: info[0] != socket.AF_INET)


def _gloo_on_loopback() -> None:
    """Make gloo listen on the loopback interface, unless ``GLOO_SOCKET_IFNAME`` says where.

    Gloo otherwise listens on the address the host name resolves to, which on most machines
    is reachable from the network.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    names = {name for _, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):
        if name in names:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


_STORES: dict[tuple[str, int], tuple[Any, int]] = {}


@atexit.register
def _close_stores() -> None:
    """Release the stores while the interpreter still runs.

    A store left to the interpreter's final teardown is destroyed in no fixed order with
    the objects it depends on, and now and then aborts the process ("terminate called
    without an active exception") after a run that succeeded.
    """
    _STORES.clear()


def _rendezvous_store(address: str, port: int, host: bool, timeout: timedelta) -> tuple[Any, int]:
    """The process's store for ``address:port`` and the number of this group on it.

    Every rank makes its groups in the same order, so the numbers agree.
    """
    import torch.distributed as dist

    key = (address, port)
    store, generation = _STORES.get(key, (None, -1))
    if store is None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            address,
            port,
            is_master=host,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_on_loopback(address, port) if host else None,
        )
    else:
        store.set_timeout(timeout)
    _STORES[key] = (store, generation + 1)
    return store, generation + 1


def init_group_on_shared_store(
    backend: str,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    connections: GroupConnections | None = None,
) -> tuple[Any, str]:
    """Create the default process group on this process's store for ``address:port``;
    return the store and the group's key prefix on it.

    The ranks first wait for each other on the store, at most `rendezvous_timeout()`; a
    rank that cannot reach the store, or ranks that never arrive, end the wait with a
    `CollectiveTimeoutError` naming the address and the missing ranks. ``timeout`` then
    bounds every op of the group. ``connections`` notes the sockets the group opens.
    """
    import torch.distributed as dist

    wait = rendezvous_timeout()
    try:
        # Under torchrun the agent serves the store on MASTER_PORT (and under accord's
        # ddp_spawn with on_rank_loss="continue", the launching process); every rank joins.
        host = rank == 0 and not _agent_serves_store() and not launcher_serves_store()
        store, generation = _rendezvous_store(address, port, host, wait)
    except dist.DistNetworkError as err:
        if rank == 0:  # rank 0 serves the store: it could not listen there
            raise
        raise CollectiveTimeoutError(
            f"Rank {rank} could not reach the rendezvous at {address}:{port} within "
            f"{_seconds(wait)}: nothing answered there. Rank 0 (on node 0) serves it; start "
            "node 0 with the same MASTER_ADDR and MASTER_PORT, and check that this machine "
            f"can reach that address and port. {_WAIT_LONGER}",
            op="rendezvous",
            rank=rank,
            missing_ranks=[0],
        ) from err
    prefix = f"{attempt_prefix()}accord/{generation}/"
    init_group_on_prefix(
        backend, store, prefix, address, port, rank, world_size, timeout, connections
    )
    return store, prefix


def init_group_on_prefix(
    backend: str,
    store: Any,
    prefix: str,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    connections: GroupConnections | None = None,
) -> None:
    """Create the default process group on ``store``'s keys under ``prefix`` (a prefix no
    group used before), once every rank checked in there (see `init_group_on_shared_store`;
    ``address`` and ``port`` are where the store is served, for the messages).
    ``connections`` notes the sockets the group opens."""
    import torch.distributed as dist

    wait = rendezvous_timeout()
    store.set_timeout(wait)
    group_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    _wait_for_every_rank(group_store, address, port, rank, world_size, wait)
    # From here on the store serves the group's own traffic (gloo's connections, sub-groups),
    # which may wait as long as an op.
    store.set_timeout(timeout)
    if "gloo" in backend and _loopback(address, port) is not None:
        _gloo_on_loopback()
    if connections is not None:
        connections.before()
    dist.init_process_group(
        backend, store=group_store, rank=rank, world_size=world_size, timeout=timeout
    )
    if connections is not None:
        connections.after(port)


def _agent_serves_store() -> bool:
    """Whether torchelastic's agent serves the store on ``MASTER_PORT`` (torchrun sets
    ``TORCHELASTIC_USE_AGENT_STORE=True``), so no rank may serve one there."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


LAUNCHER_STORE_ENV_VAR = "ACCORD_LAUNCHER_SERVES_STORE"
"""Set to ``1`` by a launcher that serves the rendezvous store itself on ``MASTER_PORT``
(so it outlives every rank), for the ranks it starts: then no rank serves one."""


def launcher_serves_store() -> bool:
    """Whether the launcher that started this rank serves the store (`LAUNCHER_STORE_ENV_VAR`)."""
    return os.environ.get(LAUNCHER_STORE_ENV_VAR) == "1"


def serve_store(address: str, port: int) -> Any:
    """Serve a rendezvous store on ``address:port`` in this process, for ranks started with
    `LAUNCHER_STORE_ENV_VAR` set; it lives as long as the returned object."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        address,
        port,
        is_master=True,
        timeout=rendezvous_timeout(),
        wait_for_workers=False,
        master_listen_fd=listen_on_loopback(address, port),
    )


def attempt_prefix() -> str:
    """A key prefix per torchelastic attempt, or ``""`` outside torchrun's agent store.

    The agent's store outlives a restarted group: the keys of an earlier attempt (its
    check-ins, gloo's addresses) are still there, and a restarted group that read them
    would wait forever for ranks that are gone.
    """
    if not _agent_serves_store():
        return ""
    return f"torchelastic/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _seconds(value: timedelta) -> str:
    return f"{value.total_seconds():g} s"


def _wait_for_every_rank(
    store: Any, address: str, port: int, rank: int, world_size: int, wait: timedelta
) -> None:
    """Check in on ``store`` and return when every rank has, or raise after ``wait``."""
    import torch.distributed as dist

    store.set(f"arrived/{rank}", "1")
    # The last rank to arrive opens the gate, so each rank waits on one key, not world_size.
    if store.add("arrived", 1) == world_size:
        store.set("all_arrived", "1")
    try:
        store.wait(["all_arrived"], wait)
    except dist.DistError as err:
        missing = _missing_ranks(store, world_size)
        _leave_together(store, rank, wait)
        if missing:
            ranks = "rank" if len(missing) == 1 else "ranks"
            who = f"{ranks} {', '.join(map(str, missing))} of {world_size} did not arrive"
        else:
            who = f"not every one of the {world_size} ranks arrived"
        raise CollectiveTimeoutError(
            f"Rank {rank} gave up waiting at the rendezvous at {address}:{port}: {who} within "
            f"{_seconds(wait)}. Check that every node was started, with its own NODE_RANK and "
            "the same MASTER_ADDR and MASTER_PORT, and that the other machines can reach "
            f"this address and port. {_WAIT_LONGER}",
            op="rendezvous",
            rank=rank,
            missing_ranks=missing,
        ) from err


def _leave_together(store: Any, rank: int, wait: timedelta) -> None:
    """Keep rank 0's store up until every rank that arrived has read who is missing.

    Rank 0 serves the store and its process ends with the error; a rank that gave up a
    moment later would otherwise find the store gone and could not name the missing ranks.
    """
    import torch.distributed as dist

    try:
        if rank != 0:
            store.add("gave_up", 1)
            return
        arrived = int(store.add("arrived", 0))
        deadline = time.monotonic() + wait.total_seconds()
        while int(store.add("gave_up", 0)) < arrived - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except dist.DistError:
        return  # rank 0 has gone already


def _missing_ranks(store: Any, world_size: int) -> list[int]:
    """The ranks that have not checked in (empty when the store cannot be asked)."""
    import torch.distributed as dist

    try:
        return [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
    except dist.DistError:
        return []  # rank 0, which serves the store, has gone
