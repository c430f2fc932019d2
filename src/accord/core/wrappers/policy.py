"""Which wrappers a strategy's collective gets, decided in one place.

The order is fixed: the debug check sits closest to the backend (it compares the real
calls), statistics count what the user's code asked for, and the watchdog is outermost so
it times everything below it, the debug check's own round trip included. A layer already
present is never added twice.
"""

from __future__ import annotations

import os

from accord.core.collective import Collective
from accord.core.timeouts import timeout_from_env
from accord.core.wrappers.debug import DebugCollective
from accord.core.wrappers.recorder import RecordingCollective
from accord.core.wrappers.stats import CollectiveStats, InstrumentedCollective
from accord.core.wrappers.trace_files import TRACE_DIR_ENV_VAR
from accord.core.wrappers.watchdog import WatchdogCollective
from accord.core.wrappers.wrapper import CollectiveWrapper
from accord.errors import ConfigurationError

__all__ = [
    "DEBUG_ENV_VAR",
    "has_layer",
    "maybe_debug",
    "maybe_record",
    "maybe_watchdog",
    "wrap_collective",
]

DEBUG_ENV_VAR = "ACCORD_DEBUG_COLLECTIVES"
"""``1`` wraps strategies' collectives in `DebugCollective`; ``strict`` also compares call sites."""

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def has_layer(collective: Collective, kind: type[Collective]) -> bool:
    """Whether ``collective`` is a ``kind`` or wraps one at any depth."""
    layer = collective
    while not isinstance(layer, kind):
        if not isinstance(layer, CollectiveWrapper):
            return False
        layer = layer.inner
    return True


def maybe_debug(collective: Collective) -> Collective:
    """Wrap ``collective`` in a `DebugCollective` when ``ACCORD_DEBUG_COLLECTIVES`` asks for it.

    ``1`` (or ``true``/``yes``/``on``) turns checking on, ``strict`` also compares call
    sites, unset/``0`` returns ``collective`` unchanged. A collective that is already
    checked is not wrapped twice.

    Raises:
        ConfigurationError: the variable holds another value.
    """
    raw = os.environ.get(DEBUG_ENV_VAR, "")
    value = raw.strip().lower()
    if value in _OFF:
        return collective
    if value not in (*_ON, "strict"):
        raise ConfigurationError(
            f"{DEBUG_ENV_VAR}={raw!r} is not understood; use 1 (check every collective), "
            "strict (also require the same calling line on every rank) or 0 (off)."
        )
    if has_layer(collective, DebugCollective):
        return collective
    return DebugCollective(collective, compare_call_sites=value == "strict")


def maybe_watchdog(collective: Collective) -> Collective:
    """Wrap ``collective`` in a `WatchdogCollective` when ``ACCORD_COLLECTIVE_TIMEOUT`` is set.

    The variable is the timeout in seconds; unset, empty or ``0`` returns ``collective``
    unchanged. A collective that is already watched is not wrapped twice. The same value
    is the op timeout of the process group a `ProcessGroupCollective` creates, so an op
    that every rank reached but that cannot complete fails too.

    Raises:
        ConfigurationError: the variable is not a number of seconds.
    """
    timeout = timeout_from_env()
    if timeout is None or has_layer(collective, WatchdogCollective):
        return collective
    return WatchdogCollective(collective, timeout)


def wrap_collective(
    collective: Collective,
    *,
    debug: bool = False,
    stats: CollectiveStats | None = None,
    watchdog: bool = True,
) -> Collective:
    """``collective`` with the wrappers a strategy asks for and the environment turns on.

    Args:
        collective: the backend collective (or one a user already wrapped).
        debug: check every call (`DebugCollective`), whatever ``ACCORD_DEBUG_COLLECTIVES`` says.
        stats: count calls and time into these statistics (`InstrumentedCollective`).
        watchdog: let ``ACCORD_COLLECTIVE_TIMEOUT`` add a `WatchdogCollective` (False
            where ranks may be lost and the run goes on: its store lives on rank 0).

    With the debug check or the watchdog on (or ``ACCORD_TRACE_DIR`` set), a
    `RecordingCollective` sits closest to the backend (`maybe_record`).
    """
    wrapped = maybe_debug(maybe_record(collective, debug=debug))
    if debug and not has_layer(wrapped, DebugCollective):
        wrapped = DebugCollective(wrapped)
    if stats is not None and not has_layer(wrapped, InstrumentedCollective):
        wrapped = InstrumentedCollective(wrapped, stats)
    return maybe_watchdog(wrapped) if watchdog else wrapped


def maybe_record(collective: Collective, *, debug: bool = False) -> Collective:
    """Wrap ``collective`` in a `RecordingCollective` when a failure should leave a trace.

    Recording is on when ``debug`` is true, ``ACCORD_DEBUG_COLLECTIVES`` or
    ``ACCORD_COLLECTIVE_TIMEOUT`` turn the debug check or the watchdog on, or
    ``ACCORD_TRACE_DIR`` is set; a `CollectiveMismatchError` or `CollectiveTimeoutError`
    then leaves each rank's last calls in a file the message names. A collective that is
    already recorded is not wrapped twice.
    """
    if has_layer(collective, RecordingCollective):
        return collective
    wanted = debug or bool(os.environ.get(TRACE_DIR_ENV_VAR, "").strip())
    if not wanted:
        wanted = os.environ.get(DEBUG_ENV_VAR, "").strip().lower() not in _OFF
    if not wanted:
        try:
            wanted = timeout_from_env() is not None
        except ConfigurationError:
            wanted = False  # maybe_watchdog says what is wrong with the value
    return RecordingCollective(collective) if wanted else collective
