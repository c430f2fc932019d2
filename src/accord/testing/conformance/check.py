"""What one conformance check is: its name, what it checks, and where it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from accord.core.collective import Collective

__all__ = ["BOTH_MODES", "Check", "CheckContext", "CollectiveFactory", "Mode"]

CollectiveFactory = Callable[[], Collective]
"""Returns a collective that is not set up yet (a class, or a callable building one)."""


class Mode(str, Enum):
    """How the ranks a check runs on were started."""

    MULTI_PROCESS = "multi-process"
    """`run_conformance` started one fresh process per rank itself."""
    IN_PROCESS = "in-process"
    """An outside launcher started the ranks; each calls `run_checks_in_this_process`."""


BOTH_MODES = frozenset(Mode)
"""Every mode: the default of `Check.modes`."""


@dataclass(frozen=True)
class CheckContext:
    """What a check receives on one rank.

    Attributes:
        collective: the suite's collective, set up on this rank.
        factory: builds more collectives like it (for the lifecycle checks).
        rank, world_size: what the launcher assigned this process (``RANK``,
            ``WORLD_SIZE``), which a collective local to each process may differ from.
    """

    collective: Collective
    factory: CollectiveFactory
    rank: int
    world_size: int


@dataclass(frozen=True)
class Check:
    """One line of the collective contract, checked on every rank of a run.

    A check does all its communication before it asserts anything, so one rank's failed
    assertion never leaves the others waiting in a collective it skipped.

    Attributes:
        name: how reports and ``checks=`` name it (``"all_reduce.mean"``).
        summary: what it checks, in one sentence.
        run: raises `BrokenContractError` (or anything else) when the contract line is broken.
        modes: the ways of starting the ranks it runs under.
        min_world_size: the smallest collective world size it means something at; at a
            smaller one it is skipped on every rank, as a pass.
    """

    name: str
    summary: str
    run: Callable[[CheckContext], None]
    modes: frozenset[Mode] = BOTH_MODES
    min_world_size: int = 1

    def applies(self, mode: Mode, world_size: int) -> bool:
        """Whether the check runs under ``mode`` on a collective of ``world_size`` ranks."""
        return mode in self.modes and world_size >= self.min_world_size
