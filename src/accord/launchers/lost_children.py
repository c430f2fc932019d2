"""`LostChildren`: the ranks a `SubprocessScriptLauncher` started that the run went on
without, under ``Trainer(on_rank_loss="continue")``.

A child that dies is noted on the rendezvous store (`accord.launchers.loss_notes`), so the
survivors count it gone at once; one the survivors left out while it still runs (frozen) is
stopped; and a lost child with restarts left is started again as a replacement, once the
others went on without it, to rejoin the run at its next step boundary.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

from accord.launchers.loss_notes import LossNotes

__all__ = ["LostChildren", "how_it_ended", "is_stopped"]

_log = logging.getLogger(__name__)


def how_it_ended(code: int) -> str:
    """How a child process ended, as the end of a sentence about it (``"exited with code
    1"``, ``"was killed by signal 9 (exit code -9)"``)."""
    if code < 0:
        return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP), so frozen; False
    where ``/proc`` cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold spaces.
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


class LostChildren:
    """The children lost while the run went on without them, and their replacements.

    Local ranks count from 1, as the launcher's ``children`` (local rank 0 is the launching
    process itself).

    Args:
        member: the member id (the rank when the group first formed) of a local rank.
    """

    def __init__(self, member: Callable[[int], int]) -> None:
        self.member = member
        self.lost: dict[int, int] = {}
        """The local ranks lost, with how each ended (its exit code)."""
        self.to_restart: set[int] = set()
        """The lost local ranks to start again once the others went on without them."""
        self.restarts: dict[int, int] = {}
        """How many times each local rank was started again."""

    def note(self, notes: LossNotes, local_rank: int, code: int, max_restarts: int) -> None:
        """A child died while the run goes on without it: say so, and leave its cause on
        the rendezvous store, where the other ranks look when they regroup."""
        self.lost[local_rank] = code
        member = self.member(local_rank)
        _log.warning(
            "local rank %d (rank %d) %s; the others go on without it.",
            local_rank,
            member,
            how_it_ended(code),
        )
        notes.lost(member, code)
        if self.restarts.get(local_rank, 0) < max_restarts:
            self.to_restart.add(local_rank)

    def restart(
        self,
        notes: LossNotes,
        children: list[subprocess.Popen[bytes]],
        start: Callable[[int], subprocess.Popen[bytes]],
        max_restarts: int,
    ) -> None:
        """Start a replacement (``start(local_rank)``) for each lost child with restarts
        left, once the others went on without it: it joins the run at the next step
        boundary."""
        for local_rank in sorted(self.to_restart):
            member = self.member(local_rank)
            if not notes.left(member):
                continue
            self.to_restart.discard(local_rank)
            notes.forget(member)
            self.restarts[local_rank] = self.restarts.get(local_rank, 0) + 1
            _log.warning(
                "starting local rank %d (rank %d) again (restart %d of %d); it rejoins the "
                "run at the next step boundary.",
                local_rank,
                member,
                self.restarts[local_rank],
                max_restarts,
            )
            children[local_rank - 1] = start(local_rank)
            del self.lost[local_rank]

    def stop_left(self, notes: LossNotes, children: list[subprocess.Popen[bytes]]) -> None:
        """Kill the children the others went on without (a frozen rank), so no process
        is left behind."""
        for local_rank, child in enumerate(children, start=1):
            if local_rank in self.lost or child.poll() is not None:
                continue
            if notes.left(self.member(local_rank)):
                child.kill()
                child.wait()
                self.lost[local_rank] = int(child.returncode)
