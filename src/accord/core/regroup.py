"""`Regrouping`: the survivors of a lost rank agree, through the rendezvous store, on who
the group is now.

Every member of a group has a member id: its rank when the group first formed (a
replacement takes the id of the member it replaces). After a failed wait each survivor
runs `Regrouping.agree` with what it has to say about itself (its ``progress``: the step
it committed, ...). The survivors meet on keys of the current generation ``g``:

1. each writes ``g<g>/here/<member>`` with its progress;
2. each waits until every member of the group either wrote its key or is gone: its
   launcher wrote how it ended (`accord.core.liveness.lost_key`), or its heartbeat
   (`accord.core.liveness`) stood still for `STALE_SECONDS`. A member that is alive but
   slow (still inside a wait of its own) is waited for, up to the group's op timeout;
3. the first survivor to decide writes the new member list with one ``compare_set`` on
   ``g<g>/decision``; every other survivor reads that list instead of its own, so the
   decision is one for all, taken by whoever got there first, never two;
4. a member the decision leaves out (it froze, and woke up after the others moved on)
   must leave: `Excluded`. Its key under ``left/`` tells its launcher to stop it.

The new group (generation ``g + 1``) meets on a fresh key prefix, ranks in the order of
their member ids. The store must outlive every training rank for this to work: it does
under torchrun (the agent serves it) and where accord's launcher serves it; where rank 0
serves it, rank 0's loss ends the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from accord.core.liveness import BEAT_SECONDS, beat_key, left_key, lost_key
from accord.errors import EXCLUDED_EXIT_CODE, RankFailureError

__all__ = ["STALE_SECONDS", "Excluded", "Regrouped", "Regrouping"]

STALE_SECONDS = 6 * BEAT_SECONDS
"""How long a member's heartbeat must stand still before the others count it gone (its
launcher's word that it ended counts at once)."""

_LOOK_SECONDS = 0.05


class Excluded(SystemExit):
    """This rank was left out of its group: the others decided it was gone (it did not
    answer in time: frozen, or stuck) and went on without it.

    A `SystemExit` with code `accord.errors.EXCLUDED_EXIT_CODE`, so a launcher knows it
    for what it is: not a failure of the run.
    """

    def __init__(self, member: int, step_note: str) -> None:
        super().__init__(EXCLUDED_EXIT_CODE)
        self.member = member
        self.step_note = step_note

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.member, self.step_note))

    def __str__(self) -> str:
        return (
            f"Member {self.member} was left out of the group {self.step_note}: the other "
            "ranks found it gone (it did not answer in time) and continue without it."
        )


@dataclass(frozen=True)
class Regrouped:
    """What the survivors agreed on.

    Attributes:
        generation: the new group's generation (the first group's is 0).
        members: the new group's member ids, in rank order.
        lost: the members of the previous group that are not in the new one.
        progress: what each member of the new group said about itself.
        causes: how a lost member ended, where its launcher said (``"SIGKILL"``).
    """

    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...]
    progress: dict[int, dict[str, Any]]
    causes: dict[int, str] = field(default_factory=dict)

    def rank_of(self, member: int) -> int:
        """The rank of ``member`` in the new group."""
        return self.members.index(member)


class Regrouping:
    """The membership of one group on its store, from generation to generation.

    Args:
        store: the rendezvous store (it must outlive the ranks that may be lost).
        prefix: the group's key prefix on it.
        members_prefix: the prefix of the members' heartbeats and launchers' notes
            (`accord.core.liveness.members_prefix`).
        member: this process's member id.
        members: the group's member ids, in rank order.
        timeout: how long to wait for a member that is alive but has not arrived.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        members_prefix: str,
        member: int,
        members: Sequence[int],
        timeout: timedelta,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.members_prefix = members_prefix
        self.member = member
        self.members = tuple(members)
        self.generation = 0
        self.timeout = timeout

    def group_prefix(self, generation: int | None = None) -> str:
        """The key prefix the group of ``generation`` (default: the current one) meets on."""
        return f"{self.prefix}g{self.generation if generation is None else generation}/"

    def agree(self, progress: dict[str, Any]) -> Regrouped:
        """Meet the other survivors and return the group they agreed on.

        Raises:
            Excluded: the others went on without this member.
            RankFailureError: the store does not answer (its host is gone).
        """
        base = f"{self.prefix}gen{self.generation}/"
        try:
            self.store.set(f"{base}here/{self.member}", json.dumps(progress))
            decision = self._decide(base)
            members = tuple(int(m) for m in json.loads(decision))
            if self.member not in members:
                raise Excluded(self.member, f"at generation {self.generation}")
            reported = {
                m: json.loads(bytes(self.store.get(f"{base}here/{m}")).decode()) for m in members
            }
            lost = tuple(m for m in self.members if m not in members)
            for m in lost:
                self.store.set(left_key(self.members_prefix, m), "1")
            causes = self._causes(lost)
        except (RuntimeError, OSError) as err:
            if isinstance(err, RankFailureError):
                raise
            raise RankFailureError(
                f"Member {self.member} could not reach the rendezvous store to regroup "
                f"({err}). The process that serves it is gone with it: under accord's ddp "
                "launcher that is rank 0 (its loss ends the run); torchrun's agent or "
                "ddp_spawn's launching process keep it through any rank's loss.",
                ranks=[0],
            ) from err
        self.generation += 1
        self.members = members
        return Regrouped(self.generation, members, lost, reported, causes)

    def _decide(self, base: str) -> str:
        """The decision on this generation: read it, or take it (see the module's text)."""
        store, key = self.store, f"{base}decision"
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds() + STALE_SECONDS
        beats: dict[int, tuple[int, float]] = {}  # member: (count, when it last moved)
        while True:
            if store.check([key]):
                return bytes(store.get(key)).decode()
            now = time.monotonic()
            here = {m for m in self.members if store.check([f"{base}here/{m}"])}
            gone = set()
            for m in self.members:
                if m in here:
                    continue
                if store.check([lost_key(self.members_prefix, m)]):
                    gone.add(m)  # its launcher saw it end
                    continue
                count = self._beat_count(m)
                seen, since = beats.get(m, (-1, now))
                if count != seen:
                    beats[m] = (count, now)
                elif now - since >= STALE_SECONDS:
                    gone.add(m)  # its heartbeat stood still: dead or frozen
            if here | gone == set(self.members) or now > deadline:
                proposal = json.dumps(sorted(here))
                return bytes(store.compare_set(key, "", proposal)).decode()
            time.sleep(_LOOK_SECONDS)

    def _beat_count(self, member: int) -> int:
        return int(self.store.add(beat_key(self.members_prefix, member), 0))

    def _causes(self, lost: Sequence[int]) -> dict[int, str]:
        causes = {}
        for member in lost:
            key = lost_key(self.members_prefix, member)
            if self.store.check([key]):
                causes[member] = bytes(self.store.get(key)).decode(errors="replace")
        return causes
