"""`MemberCollective`: the membership record every collective with a real group keeps.

Setting up makes a process a member of a group, with a rank and a world size, and either
creates that group or joins one that exists; tearing down leaves it. The record and its
checks (``rank`` before ``setup`` is an error that says so) are written here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.core.collective import Collective
from accord.errors import AccordError, CollectiveError

if TYPE_CHECKING:
    from accord.core.regroup import Regrouped

__all__ = ["MemberCollective"]


class MemberCollective(Collective):
    """A `Collective` that records this process's rank, the world size, and whether its
    ``setup`` created the group; subclasses fill the record in ``setup`` and clear it in
    ``teardown``."""

    def __init__(self) -> None:
        self._ready = False
        self._created = False
        self._rank = -1
        self._world_size = -1
        self._progress: Callable[[], str] = _nothing
        # A replacement for a lost rank, working alone until it joins (`join_running`).
        self.rejoining = False

    def report_progress(self, describe: Callable[[], str]) -> None:
        """What this rank is doing, asked when another rank needs to know (a wait that
        failed names where each rank was): ``describe()`` returns e.g. ``"step 140: train"``.
        """
        self._progress = describe

    def diagnose(self, error: BaseException, where: str) -> AccordError | None:
        """The error to raise instead of ``error``, a wait on the other ranks that failed
        (a backend's timeout, a peer's closed connection) while this rank was at ``where``:
        one that names the ranks that are gone or elsewhere; None when this collective
        cannot tell (the default)."""
        return None

    @property
    def join_pending(self) -> bool:
        """Whether a replacement rank waits to be taken in by `regroup` (``admit``)."""
        return False

    def join_running(self) -> Regrouped:
        """As a replacement for a lost rank (`rejoining`): join the running group at its
        next step boundary (see
        `accord.core.group_membership.RegroupingCollective.join_running`).

        Raises:
            CollectiveError: this collective cannot.
        """
        raise CollectiveError(f"{type(self).__name__} cannot join a running group.")

    @property
    def can_regroup(self) -> bool:
        """Whether `regroup` can form a new group of the survivors of a lost rank."""
        return False

    def regroup(self, progress: dict[str, Any], admit: bool = False) -> Regrouped:
        """Form a new group of the ranks left after a failed wait, or with ``admit`` of the
        ranks and the replacements waiting to join (see
        `accord.core.group_membership.RegroupingCollective.regroup`).

        Raises:
            CollectiveError: this collective cannot (the default).
        """
        raise CollectiveError(
            f"{type(self).__name__} cannot go on without a lost rank: it cannot form a new "
            "group of the ranks left."
        )

    @property
    @override
    def rank(self) -> int:
        self._require_setup("rank")
        return self._rank

    @property
    @override
    def world_size(self) -> int:
        self._require_setup("world_size")
        return self._world_size

    @property
    @override
    def is_setup(self) -> bool:
        return self._ready

    @property
    @override
    def created_group(self) -> bool:
        return self._created


def _nothing() -> str:
    return ""
