"""`Launcher`: starts the processes a strategy needs and runs the work in each."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["Launcher", "threads_per_process"]


class Launcher(ABC):
    """Starts the other ranks, runs ``fn`` on this one, and returns rank zero's result."""

    @property
    def is_interactive_compatible(self) -> bool:
        """Whether it works from a notebook or a REPL (no script to re-run)."""
        return False

    @abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on every rank; return what it returned on rank zero."""


def threads_per_process(processes: int) -> int:
    """Each local process's share of the cores, so N processes do not oversubscribe them.

    An ``OMP_NUM_THREADS`` the user set wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, processes))
