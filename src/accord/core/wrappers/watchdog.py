"""`WatchdogCollective`: a collective call that waits too long fails, naming who is missing.

A rank that never reaches a collective (stuck in other work, dead, or on a different code
path) makes every other rank wait inside the backend until its own timeout, often 30
minutes, with an error that names neither the op nor the missing rank. `WatchdogCollective`
wraps any collective and, before each group operation, checks in at a small
`torch.distributed.TCPStore` that rank 0 hosts: every rank records which call it is at
and waits, for at most ``timeout``, until all ranks have checked in. Only then does the
real operation start. The rank that arrives last also checks that every rank reached this
call with the same op, so ranks that call, say, ``all_reduce`` and ``barrier`` at the same
step raise `CollectiveMismatchError` instead of meeting in the backend. A rank that waits
too long:

* logs this rank's Python stacks (`faulthandler`'s dump, at ERROR on its `accord.log` logger),
* marks the call abandoned in the store, so the other waiting ranks (and the late rank,
  when it arrives) fail at once instead of timing out one by one, and
* raises `CollectiveTimeoutError` naming the op, the waiting rank, the ranks that have
  not arrived and the last call each of them entered (op and ``file:line``).

Why a store and not ``torch.distributed.monitored_barrier``: that one is gloo-only and
only rank 0 learns which ranks are missing; the store works under every backend (gloo,
nccl, DeepSpeed, Horovod, ...) and tells every rank. The check costs a few store round
trips per call: a ``set`` and an ``add`` on every rank, then a ``get`` (waiting), or, on the
last rank in, a ``delete_key``, a ``multi_get`` and a ``compare_set`` (releasing).

Limits: ``send``/``recv`` are not watched (only two ranks take part). Once all ranks have
arrived, the operation itself runs under the backend's own timeout, so a rank that fails
inside the op leaves the others to that timeout. Different shapes or dtypes at the same
call are `DebugCollective`'s job; put the watchdog outside it:
``WatchdogCollective(DebugCollective(inner), timeout)``. After a timeout the collective
refuses further operations: tear it down.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import Self, override

from accord.core.collective import Collective
from accord.core.rendezvous import listen_on_loopback
from accord.core.timeouts import as_timedelta
from accord.core.wrappers.recorder import leave_trace
from accord.core.wrappers.wrapper import CallSite, CollectiveWrapper, OpCall, call_site
from accord.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
)

if TYPE_CHECKING:
    # torch.distributed re-exports these without declaring them; this is where they live.
    from torch._C._distributed_c10d import Store

__all__ = ["WatchdogCollective"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_OK = b"ok"
_MISMATCH = b"mismatch"
# How long rank 0 keeps its store up at teardown for the other ranks' last requests.
_TEARDOWN_GRACE = timedelta(seconds=5)


class WatchdogCollective(CollectiveWrapper):
    """A collective whose group operations fail with `CollectiveTimeoutError` after ``timeout``.

    Every group operation (tensor ops, ``barrier``, object ops; not ``send``/``recv``)
    first checks in at a TCPStore hosted by rank 0 (see the module docs). A rank that
    waits longer than ``timeout`` for the others logs its stacks and raises
    `CollectiveTimeoutError` naming the op and the ranks that have not arrived; the other
    ranks then fail at once too. Ranks that arrive with different ops raise
    `CollectiveMismatchError`. With a world of one there is no store and no check.

    Args:
        inner: the collective to watch (any backend).
        timeout: seconds (or a timedelta) a rank may wait for the others to reach the
            same call.
        host: address of rank 0, where the watchdog's TCPStore listens on a free port
            (default: ``MASTER_ADDR``, else ``127.0.0.1``). Every rank must reach it. A
            loopback host is the only address the store listens on; for any other it
            listens on every interface.
        dump_stacks: log this rank's Python stacks (at ERROR) on a timeout.
    """

    def __init__(
        self,
        inner: Collective,
        timeout: float | timedelta = 300.0,
        *,
        host: str | None = None,
        dump_stacks: bool = True,
    ) -> None:
        super().__init__(inner)
        self.timeout = as_timedelta(timeout)
        self.host = host
        self.dump_stacks = dump_stacks
        self._store: Store | None = None
        self._calls = 0
        self._failure: str | None = None
        self._store_lost = False
        self._abandoned = False

    # ----------------------------------------------------------------- lifecycle
    @override
    def setup(self, **kwargs: Any) -> Self:
        self._inner.setup(**kwargs)
        if self._store is None and self._inner.world_size > 1:
            self._store = self._connect()
            self._calls = 0
            self._failure = None
            self._store_lost = False
            self._abandoned = False
        return self

    def _connect(self) -> Store:
        try:
            from torch._C._distributed_c10d import TCPStore
        except ImportError as err:
            raise CollectiveError(
                "WatchdogCollective needs torch.distributed, which this torch build lacks."
            ) from err

        rank = self._inner.rank
        host = self.host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        store: Store | None = None
        port, problem = -1, ""
        if rank == 0:
            try:
                # On a loopback host (a one-machine job) only loopback can reach the store.
                listener = listen_on_loopback(host, 0)
                store = TCPStore(
                    host,
                    0,
                    None,
                    True,
                    self.timeout,
                    wait_for_workers=False,
                    master_listen_fd=listener,
                )
                port = store.port
            except (RuntimeError, CollectiveError) as err:
                problem = str(err)
        # Rank 0 names its port (or -1 when its store failed, so no rank waits for it).
        port = Collective.broadcast_object(self, port, 0)
        if port < 0:
            raise CollectiveError(
                f"WatchdogCollective could not start its TCPStore on rank 0 at {host!r}: "
                f"{problem or 'see rank 0'}. Pass host= an address of rank 0 that every rank "
                "can reach."
            )
        if store is None:
            try:
                store = TCPStore(host, port, None, False, self.timeout)
            except RuntimeError as err:
                raise CollectiveError(
                    f"Rank {rank} could not reach the watchdog's TCPStore on rank 0 at "
                    f"{host}:{port}: {err}. Pass host= an address of rank 0 that every rank "
                    "can reach."
                ) from err
        store.set(f"pos/{rank}", "0\tsetup\t")
        return store

    @override
    def abandon(self) -> None:
        self._abandoned = True
        self._inner.abandon()

    @override
    def teardown(self) -> Self:
        store, self._store = self._store, None
        if store is not None and not self._store_lost:
            try:
                # Rank 0 hosts the store: it waits (briefly) until every rank is done with
                # it, so a late rank still learns that its call was abandoned; not when
                # the run failed elsewhere, where a rank may be gone for good.
                if store.add("left", 1) == self._inner.world_size:
                    store.set("all_left", "1")
                elif self._inner.rank == 0 and (self._failure or not self._abandoned):
                    store.wait(["all_left"], _TEARDOWN_GRACE)
            except RuntimeError:
                pass  # a rank never came to teardown, or rank 0's store is already gone
        self._inner.teardown()
        return self

    # ------------------------------------------------------------------ the hook
    @override
    def _run(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        self._require_setup(call.op)
        if self._failure is not None:
            raise CollectiveError(
                f"{call.op}: this collective already failed ({self._failure}); its ranks "
                "are out of step. Tear it down."
            )
        store = self._store
        if store is None or call.is_point_to_point:
            return perform()
        self._calls += 1
        site, _ = call_site()
        try:
            self._arrive(store, call.op, self._calls, site)
        except CollectiveError as err:
            leave_trace(self, call, err, site)  # the rank's last calls, named in the message
            raise
        return perform()

    def _arrive(self, store: Store, op: str, number: int, site: CallSite) -> None:
        """Check in at call ``number`` and wait until every rank has; raise on a timeout."""
        rank = self._inner.rank
        where = f"{op} (call #{number} at {site})"
        try:
            verdict = self._check_in(store, op, number, site)
        except RuntimeError as err:  # the store's own errors (DistNetworkError, ...)
            self._store_lost = True
            self._fail(f"lost contact with the watchdog store during {where}")
            raise CollectiveError(
                f"Rank {rank} lost contact with the watchdog's TCPStore on rank 0 during "
                f"{where}: {err}. Rank 0 has probably exited; see its error." + self._stacks_note()
            ) from err
        if isinstance(verdict, list):  # this rank gave up waiting
            missing = [r for r, _ in verdict]
            lines = "\n".join(f"  rank {r}: {last}" for r, last in verdict) or (
                "  (every rank had checked in, but the last had not released the call yet)"
            )
            message = (
                f"Rank {rank} waited {self._seconds} in {where} for ranks {missing}, which "
                f"have not arrived:\n{lines}\nA rank that does not arrive is stuck in other "
                "work, has died, or makes a different sequence of collective calls "
                "(DebugCollective checks the sequence)."
            )
            self._fail(message)
            raise CollectiveTimeoutError(
                message + self._stacks_note(), op=op, rank=rank, missing_ranks=missing
            )
        if verdict.startswith(_MISMATCH + b"\n"):
            calls = []
            for other, position in enumerate(verdict.split(b"\n")[1:]):
                seen, other_op, other_site = position.decode(errors="replace").split("\t", 2)
                calls.append({"rank": other, "call": int(seen), "op": other_op, "site": other_site})
            lines = "\n".join(
                f"  rank {c['rank']}: {c['op']} [call #{c['call']}] at {c['site']}" for c in calls
            )
            raise CollectiveMismatchError(
                f"Collective mismatch: the ranks reached call #{number} with different ops. "
                f"Nothing was sent, and every rank raises this error:\n{lines}\nEvery rank "
                "must make the same collective calls in the same order.",
                calls,
            )
        if verdict != _OK:
            fields = verdict.decode(errors="replace").split("\t", 3)
            _, waiter, waiter_op, ranks = fields if len(fields) == 4 else ["", "?", "?", ""]
            missing = [int(r) for r in ranks.split(",") if r.isdigit()]
            message = (
                f"Rank {rank}: {where} was abandoned: rank {waiter} waited {self._seconds} "
                f"in {waiter_op} for ranks {missing} and gave up. See rank {waiter}'s "
                "CollectiveTimeoutError."
            )
            self._fail(message)
            raise CollectiveTimeoutError(
                message + self._stacks_note(), op=op, rank=rank, missing_ranks=missing
            )

    def _check_in(
        self, store: Store, op: str, number: int, site: CallSite
    ) -> bytes | list[tuple[int, str]]:
        """The verdict on call ``number``: ``b"ok"``, another rank's abandon mark, or,
        when this rank gave up, the ranks that had not arrived (with their last call)."""
        rank, world_size = self._inner.rank, self._inner.world_size
        store.set(f"pos/{rank}", f"{number}\t{op}\t{site}")
        key = f"go/{number}"
        # Every rank adds once per call and none passes call n before all reached it, so
        # the rank that brings the counter to n * world_size is the last one in.
        if store.add("arrivals", 1) == number * world_size:
            if number > 1:
                store.delete_key(f"go/{number - 1}")  # every rank is past it
            # One more round trip catches ranks that arrived with different ops, which
            # would otherwise meet in the backend and hang there.
            positions = self._positions(store)
            if len({position.split(b"\t", 2)[1] for position in positions}) == 1:
                return store.compare_set(key, "", "ok")
            # The verdict carries the positions: by the time another rank reads them,
            # this rank may have checked in at its next call.
            return store.compare_set(key, "", b"\n".join([_MISMATCH, *positions]).decode())
        try:
            return store.get(key)  # blocks for at most the store's timeout
        except RuntimeError:
            pass
        missing = self._missing(store, number)
        mark = f"abandoned\t{rank}\t{op}\t{','.join(str(r) for r, _ in missing)}"
        # compare_set, not set: if the last rank released the call meanwhile, "ok" stays.
        verdict = store.compare_set(key, "", mark)
        return missing if verdict == mark.encode() else verdict

    def _positions(self, store: Store) -> list[bytes]:
        """Every rank's last check-in, ``b"<call>\\t<op>\\t<site>"``, in rank order."""
        return store.multi_get([f"pos/{r}" for r in range(self._inner.world_size)])

    def _missing(self, store: Store, number: int) -> list[tuple[int, str]]:
        """The ranks that have not checked in at call ``number``, with their last call."""
        missing: list[tuple[int, str]] = []
        for other in range(self._inner.world_size):
            key = f"pos/{other}"
            if other == self._inner.rank:
                continue
            if not store.check([key]):
                missing.append((other, "has not finished setup()"))
                continue
            seen, op, where = store.get(key).decode().split("\t", 2)
            if int(seen) >= number:
                continue
            if int(seen) == 0:
                missing.append((other, "has not called a collective since setup()"))
            else:
                missing.append((other, f"last entered call #{seen}: {op} at {where}"))
        return missing

    # --------------------------------------------------------------- helpers
    @property
    def _seconds(self) -> str:
        return f"{self.timeout.total_seconds():g} s"

    def _fail(self, message: str) -> None:
        self._failure = message.split("\n", 1)[0]
        if self.dump_stacks:
            _dump_stacks(f"accord watchdog, rank {self._inner.rank}: {message}")

    def _stacks_note(self) -> str:
        return (
            "\nThis rank's Python stacks were logged (accord's log, stderr by default)."
            if self.dump_stacks
            else ""
        )


def _dump_stacks(header: str) -> None:
    """Log every thread's Python stack under ``header``, as `faulthandler` writes them."""
    with tempfile.TemporaryFile("w+") as file:  # faulthandler writes to a file descriptor
        faulthandler.dump_traceback(file=file, all_threads=True)
        file.seek(0)
        stacks = file.read()
    _log.error("%s\n%s", header, stacks.rstrip())
