"""Numbers read from environment variables, through one parser.

Every number accord takes from the environment (``ACCORD_COLLECTIVE_TIMEOUT``, ``RANK``,
``SLURM_RESTART_COUNT``, ...) is read by `env_number`: an unset or blank variable means the
default, and a value that is not a number (or not a positive one, where it must be) is a
`ConfigurationError` that names the variable, its value and what to set instead.
"""

from __future__ import annotations

import os
from typing import TypeVar

from accord.errors import ConfigurationError

__all__ = ["env_number"]

_N = TypeVar("_N", int, float)
_D = TypeVar("_D")


def env_number(
    name: str,
    kind: type[_N],
    default: _D,
    *,
    positive: bool = False,
    unit: str = "",
    hint: str = "",
) -> _N | _D:
    """The number in the environment variable ``name``, or ``default`` when it is unset or
    blank.

    Args:
        name: the variable.
        kind: ``int`` or ``float``.
        default: what an unset or blank variable means.
        positive: refuse zero and negative values (and NaN).
        unit: what the number counts (``"seconds"``), for the message.
        hint: what to do instead, for the message (``"use e.g. 300"``).

    Raises:
        ConfigurationError: the value is not a number of ``kind`` (or not positive).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (positive and not value > 0):
        if unit:
            what = f"a {'positive ' if positive else ''}number of {unit}"
        else:
            noun = "integer" if kind is int else "number"
            what = f"a positive {noun}" if positive else f"{'an' if kind is int else 'a'} {noun}"
        raise ConfigurationError(f"{name}={raw!r} is not {what}{'; ' + hint if hint else ''}.")
    return value
