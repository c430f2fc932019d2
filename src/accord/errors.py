"""The exceptions accord raises, in one small hierarchy.

Every message says what happened and what to do about it.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "AccordError",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveNotSetupError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "EXCLUDED_EXIT_CODE",
    "MisconfigurationError",
    "MissingDependencyError",
    "NonFiniteValueError",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "RankFailureError",
    "did_you_mean",
]


class AccordError(Exception):
    """Base class of every error accord raises on purpose."""


class ConfigurationError(AccordError, ValueError):
    """Arguments that cannot work together (unknown names, impossible device counts, ...)."""


MisconfigurationError = ConfigurationError


class MissingDependencyError(AccordError, ImportError):
    """An optional package a feature needs is not installed (or not in a supported version,
    or does not import); `accord.imports.require` raises it.

    Args:
        feature: what needs the package.
        package: the package's import name.
        extra: accord's pip extra that installs it.
        reason: what is wrong with it, after "which" (default: it is not installed).
    """

    def __init__(
        self, feature: str, package: str, extra: str, *, reason: str = "is not installed"
    ) -> None:
        super().__init__(
            f"{feature} needs the `{package}` package, which {reason}. "
            f"Install it with `pip install 'accord[{extra}]'`."
        )
        self.feature = feature
        self.package = package
        self.extra = extra
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # A rank's error travels to the launching process pickled.
        rebuild = functools.partial(type(self), reason=self.reason)
        return (rebuild, (self.feature, self.package, self.extra))


class CollectiveError(AccordError, RuntimeError):
    """A collective operation failed or was used incorrectly."""


class CollectiveNotSetupError(CollectiveError):
    """A collective was used before `setup()` or after `teardown()`."""


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives (op, shape, dtype or arguments) at the same step.

    Raised on every rank, before any data moves. ``calls`` holds one description per rank
    (``op``, ``shape``, ``dtype``, ``site`` as ``file:line``, ...), in rank order.
    """

    def __init__(self, message: str, calls: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(message)
        self.calls = [dict(call) for call in calls]


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than its timeout for the other ranks to arrive.

    ``op`` is the operation, ``rank`` the rank that waited, ``missing_ranks`` the ranks
    that had not arrived (empty when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        rank: int | None = None,
        missing_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.missing_ranks = list(missing_ranks)


class CheckpointError(AccordError, RuntimeError):
    """A checkpoint could not be written, read or applied."""


class RankFailureError(AccordError, RuntimeError):
    """One or more ranks of a multi-process run failed.

    ``ranks`` are the ranks that failed, died or froze (empty when unknown).
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)

    def __reduce__(self) -> tuple[Any, ...]:
        # A rank's error travels to the launching process pickled.
        return (functools.partial(type(self), ranks=self.ranks), (str(self),))


class NonFiniteValueError(AccordError, FloatingPointError):
    """A training value (the loss) was NaN or infinite on at least one rank.

    Raised on every rank in the same step, so no rank trains on alone. ``ranks`` are the
    global ranks that saw the value, ``step`` the optimizer step (``global_step``) it
    happened before, ``metric`` what was checked (``"loss"``).
    """

    def __init__(self, message: str, *, ranks: Sequence[int], step: int, metric: str) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.step = step
        self.metric = metric


PREEMPTED_EXIT_CODE = 75
"""The exit status of a job stopped by a preemption signal after its checkpoint was saved
(``EX_TEMPFAIL``: try again later). torchelastic restarts a group that exits with it while
restarts are left; a scheduler may requeue it."""

EXCLUDED_EXIT_CODE = 76
"""The exit status of a rank the others left out of the group under
``Trainer(on_rank_loss="continue")`` (it did not answer in time); the run goes on without
it, so its launcher does not count it as a failure."""


class Preempted(SystemExit):
    """A fit stopped on a preemption signal, after every rank saved the checkpoint.

    A `SystemExit` with code `PREEMPTED_EXIT_CODE`: left uncaught, the process exits with
    that status and no traceback. ``checkpoint`` is the path saved, ``step`` its
    ``global_step`` and ``signal_name`` the signal (e.g. ``"SIGTERM"``).
    """

    def __init__(self, checkpoint: str, step: int, signal_name: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checkpoint = checkpoint
        self.step = step
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.checkpoint, self.step, self.signal_name))

    def __str__(self) -> str:
        return (
            f"Stopped by {self.signal_name} at step {self.step}; the run was saved to "
            f"{self.checkpoint!r}. Resume with fit(ckpt_path='last') or that path."
        )


# What the backends say when the other end of a connection has gone: gloo's pair errors,
# the OS's socket errors, NCCL's view of a dead peer.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
    "nccl communicator was aborted",
    "remote process exited",
    # A backend's wait that ran out of time: the peer froze, or is in another call.
    "timed out waiting",
    "collective operation timeout",
)


def is_communication_error(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception or its text) comes from losing contact with a peer.

    Such an error is a consequence: some other rank died or stopped first. True for
    torch.distributed's ``DistError`` family, accord's `CollectiveTimeoutError`, the
    backends' "Connection closed/reset by peer"-like messages and their timeouts ("Timed
    out waiting ... for recv"), also when they are the cause or context of ``error``.
    """
    if isinstance(error, str):
        text = error.lower()
        return any(phrase in text for phrase in _PEER_GONE)
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, CollectiveTimeoutError) or _is_dist_error(current):
            return True
        if is_communication_error(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_dist_error(error: BaseException) -> bool:
    # Without torch.distributed loaded no exception can be one of its own, and importing
    # torch here would make `import accord.errors` expensive.
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    return isinstance(dist_error, type) and isinstance(error, dist_error)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    options = list(choices)
    # The fewest edits wins; among equals, a name of the same length ("dpp" -> "ddp", not
    # "dp"), then the one difflib finds most similar.
    scored = sorted(
        (_edits(name, c), len(c) != len(name), -difflib.SequenceMatcher(None, name, c).ratio(), c)
        for c in options
    )
    close = [c for edits, *_, c in scored if edits <= max(1, len(name) // 3)]
    matches = close or difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" Did you mean {matches[0]!r}?" if matches else ""


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions turning a into b."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            )
        previous = current
    return previous[-1]
