"""`GroupConnections`: the sockets a process group opened, so a rank can close them.

A gloo group cannot be aborted: a rank that leaves a failed group keeps its connections
open as long as anything holds the group (DDP's reducer does), and a peer still waiting
on it inside an op waits for the op's whole timeout. Shutting those sockets down ends
that wait at once: the peer's op fails with a closed connection, and the peer goes to
regroup too. The sockets are the ones that appeared while the group was created; each is
remembered with its inode, so a descriptor that was closed and reused for something else
since is left alone. Listening sockets are never touched (gloo aborts the process when
its listener fails). Linux only (``/proc/self/fd``); elsewhere this does nothing.
"""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["GroupConnections", "open_sockets"]

_FDS = Path("/proc/self/fd")


def open_sockets() -> dict[int, str]:
    """This process's open sockets: descriptor to ``"socket:[inode]"`` (empty where
    ``/proc`` is not there)."""
    found: dict[int, str] = {}
    try:
        entries = list(_FDS.iterdir())
    except OSError:
        return found
    for entry in entries:
        try:
            target = str(entry.readlink())
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(entry.name)] = target
    return found


class GroupConnections:
    """The sockets opened between `before` and `after` (around a group's creation)."""

    def __init__(self) -> None:
        self._before: dict[int, str] = {}
        self._sockets: dict[int, str] = {}

    def before(self) -> None:
        """Note the sockets that exist before the group is created."""
        self._before = open_sockets()

    def after(self, store_port: int) -> None:
        """Note the sockets the group's creation added, but those of the rendezvous store
        on ``store_port`` (its clients' connections, and where this rank serves it, the
        ones it accepted): the regroup needs them."""
        now = open_sockets()
        self._sockets = {
            fd: name
            for fd, name in now.items()
            if self._before.get(fd) != name and store_port not in _ports(fd)
        }
        self._before = {}

    def sever(self) -> None:
        """Shut down every connected socket of the group that is still the same socket, so
        the peers' waits on this rank end now."""
        sockets, self._sockets = self._sockets, {}
        current = open_sockets()
        for fd, name in sockets.items():
            if current.get(fd) != name:
                continue  # closed since, maybe reused for something else
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already shut down by the peer
            finally:
                sock.detach()  # the group owns the descriptor: never close it here


def _ports(fd: int) -> tuple[int, ...]:
    """The local and remote port of socket ``fd`` (empty for one that is not TCP/IP)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return ()
    try:
        ports = []
        for address in (sock.getsockname(), _peer(sock)):
            if isinstance(address, tuple) and len(address) >= 2:
                ports.append(int(address[1]))
        return tuple(ports)
    except OSError:
        return ()
    finally:
        sock.detach()


def _peer(sock: socket.socket) -> object:
    try:
        return sock.getpeername()
    except OSError:
        return None  # a listening or unconnected socket
