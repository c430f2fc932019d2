"""`MemberCollective`: the membership record every collective with a real group keeps.

Setting up makes a process a member of a group, with a rank and a world size, and either
creates that group or joins one that exists; tearing down leaves it. The record and its
checks (``rank`` before ``setup`` is an error that says so) are written here once.
"""

from __future__ import annotations

from typing_extensions import override

from accord.core.collective import Collective

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
