"""`Liveness`: each rank's heartbeat on the rendezvous store, and who is missing when a
wait fails.

A rank that dies closes its sockets, and the ranks waiting on it in a collective fail at
once; a rank that freezes is seen only when the backend's timeout runs out. Either way the
backend's error names neither the rank nor what it was doing. So every rank of a
multi-rank group keeps a heartbeat on the store the group met on: a background thread
(its own connection to the store) adds one to the rank's counter twice a second and writes
what the rank is doing (``step 140: train``, from a callable the owner gives). When a wait
fails, `Liveness.survey` reads every counter twice, a beat apart: a rank whose counter did
not move is gone (dead, or frozen: a stopped process stops its threads too), the others
are alive and say where they are. Reading by counters, not clocks, keeps machines whose
clocks disagree from looking dead.

The store outlives a training rank when the launcher or torchrun's agent serves it; when
the rank that serves it is the one lost, the survey says the store is gone too.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from accord.errors import AccordError, CollectiveTimeoutError, RankFailureError

__all__ = [
    "BEAT_SECONDS",
    "Liveness",
    "Survey",
    "beat_key",
    "current_key",
    "join_key",
    "joins_key",
    "left_key",
    "lost_key",
    "lost_ranks_error",
    "members_prefix",
]

BEAT_SECONDS = 0.5
"""How often a rank's heartbeat counts up."""

_CONNECT = timedelta(seconds=10)


def members_prefix() -> str:
    """The key prefix of the members' heartbeats and of their launchers' notes on the
    rendezvous store (one per torchelastic attempt)."""
    from accord.core.rendezvous import attempt_prefix

    return f"{attempt_prefix()}accord/"


def beat_key(prefix: str, member: int) -> str:
    """The key of member ``member``'s heartbeat counter."""
    return f"{prefix}liveness/count/{member}"


def current_key(prefix: str) -> str:
    """The key naming the group in progress (its prefix, generation and members), for a
    replacement that joins."""
    return f"{prefix}current"


def joins_key(prefix: str) -> str:
    """The key counting the replacement ranks that asked to join; the ``i``-th request is
    under `join_key`."""
    return f"{prefix}joins"


def join_key(prefix: str, index: int) -> str:
    """The key of the ``index``-th request to join: the member id of the rank asking."""
    return f"{prefix}join/{index}"


def left_key(prefix: str, member: int) -> str:
    """The key the survivors of a regroup set for each member they went on without, so
    its launcher stops it if it still runs (frozen)."""
    return f"{prefix}left/{member}"


def lost_key(prefix: str, member: int) -> str:
    """The key where a launcher writes how member ``member``'s process ended
    (``"killed by SIGKILL"``): the survivors need not wait for its heartbeat to stand
    still, and their message says it."""
    return f"{prefix}lost/{member}"


@dataclass(frozen=True)
class Survey:
    """Who answered a liveness survey.

    Attributes:
        alive: the members whose heartbeat moved, by member id.
        gone: the members whose heartbeat stood still (dead or frozen), or who never had one.
        doing: what each member last said it was doing.
        store_reachable: False when the store itself did not answer (its host is gone).
    """

    alive: tuple[int, ...]
    gone: tuple[int, ...]
    doing: dict[int, str]
    store_reachable: bool = True

    def describe(self, members: Sequence[int]) -> str:
        """One line per member of ``members``: gone, or what it was doing."""
        lines = []
        for member in members:
            state = "gone (died or froze)" if member in self.gone else "alive"
            doing = self.doing.get(member)
            lines.append(f"rank {member}: {state}" + (f", last at {doing}" if doing else ""))
        return "; ".join(lines)


class Liveness:
    """The heartbeats of one group's members on its rendezvous store.

    Args:
        address, port: where the store is served.
        prefix: the group's key prefix on the store.
        member: this process's member id (its rank when the group was first formed).
        members: every member id of the group.
    """

    def __init__(
        self, address: str, port: int, prefix: str, member: int, members: Sequence[int]
    ) -> None:
        self.address, self.port, self.prefix = address, port, prefix
        self.member = member
        self.members = tuple(members)
        self.describe: Callable[[], str] = lambda: ""
        # Requests to join seen on the store, and those the group has taken in (or found
        # gone): a replacement waits while the first is larger.
        self.joins_seen = 0
        self.joins_handled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    def _connect(self) -> Any:
        import torch.distributed as dist

        # A store whose process is gone refuses a connection at once, but torch's client
        # retries until its timeout runs out, twice (22 s with ours), and meanwhile keeps
        # this rank from exiting: a plain connection says it first. ConnectionRefusedError
        # is an OSError, which the callers take for an unreachable store.
        socket.create_connection(
            (self.address, self.port), timeout=_CONNECT.total_seconds()
        ).close()
        return dist.TCPStore(  # type: ignore[attr-defined]
            self.address, self.port, is_master=False, timeout=_CONNECT, wait_for_workers=False
        )

    def _key(self, kind: str, member: int) -> str:
        if kind == "count":
            return beat_key(self.prefix, member)
        return f"{self.prefix}liveness/{kind}/{member}"

    def start(self, describe: Callable[[], str] | None = None) -> None:
        """Start this member's heartbeat; ``describe`` says what the rank is doing."""
        if describe is not None:
            self.describe = describe
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="accord-heartbeat", daemon=True)
        self._thread.start()

    @property
    def join_pending(self) -> bool:
        """Whether a replacement rank asked to join and has not been taken in yet."""
        return self.joins_seen > self.joins_handled

    def stop(self) -> None:
        """Stop the heartbeat (the others will see this member as gone)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)

    def _beat(self) -> None:
        try:
            store = self._store = self._connect()
        except Exception:  # the store is gone: nobody can read a heartbeat anyway
            return
        count, doing = self._key("count", self.member), self._key("doing", self.member)
        joins = joins_key(self.prefix)
        while not self._stop.is_set():
            try:
                said = self.describe()
            except Exception as err:  # a broken description must not stop the heartbeat
                said = f"(cannot say: {type(err).__name__})"
            try:
                store.set(doing, said)
                store.add(count, 1)
                self.joins_seen = int(store.add(joins, 0))
            except Exception:
                return  # the store went away with its host; there is nothing to tell
            self._stop.wait(BEAT_SECONDS)

    def survey(self, members: Sequence[int] | None = None) -> Survey:
        """Read the members' heartbeats twice, a little over two beats apart; those whose
        counter did not move are gone. Takes about a second."""
        members = tuple(self.members if members is None else members)
        try:
            store = self._connect()
            first = self._counts(store, members)
            time.sleep(2.2 * BEAT_SECONDS)
            second = self._counts(store, members)
            doing = self._doings(store, members)
        except Exception:
            return Survey((), members, {}, store_reachable=False)
        alive = tuple(m for m in members if second[m] > first[m])
        gone = tuple(m for m in members if m not in alive)
        return Survey(alive, gone, doing)

    def _counts(self, store: Any, members: Sequence[int]) -> dict[int, int]:
        return {m: int(store.add(self._key("count", m), 0)) for m in members}

    def _doings(self, store: Any, members: Sequence[int]) -> dict[int, str]:
        found: dict[int, str] = {}
        for member in members:
            key = self._key("doing", member)
            if store.check([key]):
                found[member] = bytes(store.get(key)).decode(errors="replace")
        return found


def lost_ranks_error(survey: Survey, rank: int, where: str, error: BaseException) -> AccordError:
    """The named error for a wait that failed on rank ``rank`` at ``where``, from what
    ``survey`` found: the ranks gone (`RankFailureError`), else the ranks alive elsewhere
    (`CollectiveTimeoutError`). ``error`` is the backend's, quoted at the end."""
    said = f"(The backend said: {_first_line(error)})"
    if not survey.store_reachable:
        return RankFailureError(
            f"Rank {rank} lost contact with the other ranks at {where}, and the rendezvous "
            "store no longer answers: the process that served it (rank 0, or the launcher) "
            f"is gone, and with it the whole job. Check that rank's output. {said}",
            ranks=[0],
        )
    members = sorted(set(survey.alive) | set(survey.gone))
    where_all = survey.describe(members)
    if survey.gone:
        gone = ", ".join(map(str, survey.gone))
        return RankFailureError(
            f"Rank {rank} stopped at {where}: rank{'s' if len(survey.gone) > 1 else ''} "
            f"{gone} stopped answering (the process died or froze: its heartbeat stood "
            f"still). Where each rank was: {where_all}. Check the output of rank {gone}. "
            f"{said}",
            ranks=survey.gone,
        )
    mine = survey.doing.get(rank)
    elsewhere = [m for m in members if m != rank and survey.doing.get(m) != mine]
    others = elsewhere or [m for m in members if m != rank]
    return CollectiveTimeoutError(
        f"Rank {rank} waited in vain at {where}: every rank is alive, so the ranks are in "
        "different collective calls (a call only some ranks make, such as a barrier "
        f"inside `if rank == ...`). Where each rank is: {where_all}. Rerun with "
        "ACCORD_DEBUG_COLLECTIVES=1 to name the first call where they part. "
        f"{said}",
        rank=rank,
        missing_ranks=others,
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
