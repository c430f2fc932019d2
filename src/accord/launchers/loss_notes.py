"""`LossNotes`: what a launcher tells the ranks, and learns from them, about lost ranks
under ``Trainer(on_rank_loss="continue")``, through the rendezvous store.

A launcher sees its child die before any rank does: it writes how (``"SIGKILL"``) under
the child's `accord.core.liveness.lost_key`, so the survivors count it gone at once and
name the cause. The survivors write `accord.core.liveness.left_key` for each rank they went
on without; a launcher stops such a child if it still runs (frozen), so no process is
left behind.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta
from typing import Any

from accord.core.liveness import left_key, lost_key, members_prefix
from accord.environments.cluster_environment import ClusterEnvironment

__all__ = ["LossNotes", "cause_of"]

_log = logging.getLogger(__name__)


def cause_of(code: int) -> str:
    """How a process ended, in a word or two (``"SIGKILL"``, ``"exit code 1"``)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class LossNotes:
    """A launcher's connection to the rendezvous store, for notes on lost ranks.

    Args:
        environment: where the store is served (its main address and port).
        store: the store itself, where the launcher serves it; else a client connects on
            first use. Without a store (none yet, or gone) the notes are skipped: the
            heartbeats tell the ranks anyway.
    """

    def __init__(self, environment: ClusterEnvironment, store: Any = None) -> None:
        self.environment = environment
        self._store = store
        self._prefix = members_prefix()

    def _connect(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            env = self.environment
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                env.main_address,
                env.main_port,
                is_master=False,
                timeout=timedelta(seconds=10),
                wait_for_workers=False,
            )
        return self._store

    def lost(self, member: int, code: int) -> None:
        """Note that member ``member``'s process ended with ``code``."""
        try:
            self._connect().set(lost_key(self._prefix, member), cause_of(code))
        except Exception:
            _log.debug("could not note rank %d's loss on the store", member, exc_info=True)

    def left(self, member: int) -> bool:
        """Whether the survivors went on without member ``member``."""
        try:
            return bool(self._connect().check([left_key(self._prefix, member)]))
        except Exception:
            return False
