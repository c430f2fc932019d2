"""The exceptions accord raises, in one small hierarchy.

Every message says what happened and what to do about it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AccordError",
    "CheckpointError",
    "CollectiveError",
    "CollectiveNotSetupError",
    "ConfigurationError",
    "MisconfigurationError",
    "MissingDependencyError",
    "RankFailureError",
    "did_you_mean",
]


class AccordError(Exception):
    """Base class of every error accord raises on purpose."""


class ConfigurationError(AccordError, ValueError):
    """Arguments that cannot work together (unknown names, impossible device counts, ...)."""


MisconfigurationError = ConfigurationError


class MissingDependencyError(AccordError, ImportError):
    """An optional package a feature needs is not installed."""

    def __init__(self, feature: str, package: str, extra: str) -> None:
        super().__init__(
            f"{feature} needs the `{package}` package, which is not installed. "
            f"Install it with `pip install 'accord[{extra}]'`."
        )
        self.feature = feature
        self.package = package
        self.extra = extra


class CollectiveError(AccordError, RuntimeError):
    """A collective operation failed or was used incorrectly."""


class CollectiveNotSetupError(CollectiveError):
    """A collective was used before `setup()` or after `teardown()`."""


class CheckpointError(AccordError, RuntimeError):
    """A checkpoint could not be written, read or applied."""


class RankFailureError(AccordError, RuntimeError):
    """One or more ranks of a multi-process run failed."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {matches[0]!r}?" if matches else ""
