"""How long a collective op may wait, and what a backend's own timeout inside one becomes.

`DEFAULT_TIMEOUT` is torch's 30 minutes; ``ACCORD_COLLECTIVE_TIMEOUT`` (`timeout_from_env`)
replaces it for every group accord creates and turns the watchdog on. A backend that runs
out of time inside an op says so in its own words; `BackendTimeouts` raises that as a
`CollectiveTimeoutError` naming the op.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from accord.core.env_vars import env_number
from accord.errors import CollectiveError, CollectiveTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV_VAR",
    "BackendTimeouts",
    "as_timedelta",
    "timeout_from_env",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long an op may wait for the other ranks before it fails (torch's own default)."""

TIMEOUT_ENV_VAR = "ACCORD_COLLECTIVE_TIMEOUT"
"""Seconds; when set, the watchdog's wait and the op timeout of every group accord creates."""

_HINT = "use e.g. 300, or 0 for off"

# How gloo (and torch's own wait) say that an op ran out of time.
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def timeout_from_env() -> timedelta | None:
    """``ACCORD_COLLECTIVE_TIMEOUT`` as a timedelta; None when it is unset, empty or ``0``
    (negative values count as off too).

    Raises:
        ConfigurationError: the variable is not a number of seconds.
    """
    seconds = env_number(TIMEOUT_ENV_VAR, float, 0.0, unit="seconds", hint=_HINT)
    return timedelta(seconds=seconds) if seconds > 0 else None


class BackendTimeouts:
    """A context manager that raises a backend's own timeout inside ``op`` as
    `CollectiveTimeoutError` naming ``op``; other errors pass through unchanged.

    Every rank may have called ``op`` and still not finish it: gloo waits for bytes a rank
    with a different shape never sends. A class rather than a generator, so that a
    collective keeps one per op and entering it costs two plain method calls.

    Args:
        op: the operation's public name, for the message.
        rank: this rank, for the message.
        timeout: the group's op timeout, for the message.
    """

    __slots__ = ("op", "rank", "timeout")

    def __init__(self, op: str, rank: int, timeout: timedelta) -> None:
        self.op = op
        self.rank = rank
        self.timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, _: Any) -> None:
        if err is not None:
            self.raise_timeout(err)

    def raise_timeout(self, err: BaseException) -> None:
        """Raise ``err`` as `CollectiveTimeoutError` if it is the backend's timeout; return
        otherwise (the caller re-raises it as it is). For a hot path that catches the
        backend's error itself instead of entering the guard."""
        if not isinstance(err, RuntimeError) or isinstance(err, CollectiveError):
            return
        if not _TIMED_OUT.search(str(err)):
            return
        raise CollectiveTimeoutError(
            f"Rank {self.rank}: {self.op} did not complete within the process group's timeout "
            f"of {self.timeout.total_seconds():g} s. Either a rank never called it, or the ranks "
            "called it with different shapes, dtypes or roots (the backend then waits for "
            "data that never comes), or a rank stopped inside it. Run with "
            f"ACCORD_DEBUG_COLLECTIVES=1 to compare every call across ranks. The backend "
            f"said: {err}",
            op=self.op,
            rank=self.rank,
        ) from err


def as_timedelta(timeout: timedelta | float | None) -> timedelta:
    """``timeout`` (seconds or a timedelta; None: `DEFAULT_TIMEOUT`) as a positive timedelta.

    Raises:
        TypeError: neither a number nor a timedelta.
        ValueError: zero or negative.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {timeout!r}.")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value}.")
    return value
