"""accord's own messages: Python `logging` under the ``"accord"`` logger.

Every module that says something logs to ``logging.getLogger(__name__)``, a child of
``"accord"`` (``"accord.trainer.preemption"``, ``"accord.launchers.subprocess_script"``,
...). What only one rank should say goes through the rank-zero helpers here, which log on
global rank zero only (lightning-utilities' ``rank_zero_only``; the strategy sets the rank
when it sets up, and until then it comes from ``RANK``, ``SLURM_PROCID`` or
``LOCAL_RANK``). Warnings stay `warnings.warn`; on rank zero only through
lightning-utilities' ``rank_zero_warn``, once per process through its ``WarningCache``.

Until you configure logging, accord's messages are printed to stderr as ``[accord]
<message>``, from INFO up (the ``"accord"`` logger's level is INFO unless you set one).
Its handler steps aside as soon as you configure logging yourself: once the root logger
has a handler (``logging.basicConfig(...)``, pytest), or a logger between the message's
and ``"accord"`` has one of yours, the message goes only there. So::

    logging.getLogger("accord").setLevel(logging.ERROR)  # silence all but errors
    logging.getLogger("accord").addHandler(logging.FileHandler("accord.log"))  # redirect

Each process has its own handler: ranks started by accord's launchers (or torchrun, or
SLURM) import accord and print their own messages; the rank-zero helpers keep the ones
the whole job shares to one rank.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, TextIO

from lightning_utilities.core.rank_zero import rank_zero_only

from accord.core.env_vars import env_number
from accord.errors import ConfigurationError

__all__ = ["LOGGER_NAME", "rank_zero_debug", "rank_zero_info", "rank_zero_warning"]

LOGGER_NAME = "accord"
"""The logger every accord module's logger descends from."""

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK")


class _UntilConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr (whatever ``sys.stderr`` is at the time), while nobody else handles a record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[accord] %(message)s"))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """Kept for `logging.StreamHandler.__init__`; this handler always writes to stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger.name != "root":
            if any(handler is not self for handler in logger.handlers):
                return False
            logger = logger.parent
        return bool(super().filter(record))


def _rank_from_environment() -> int:
    """This process's global rank as its launcher's variables say, before a strategy knows
    (a malformed one is reported where it is used, not here)."""
    for name in _RANK_VARIABLES:
        with contextlib.suppress(ConfigurationError):
            rank = env_number(name, int, None)
            if rank is not None:
                return rank
    return 0


def _install() -> None:
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(handler, _UntilConfigured) for handler in logger.handlers):
        logger.addHandler(_UntilConfigured())
    if getattr(rank_zero_only, "rank", None) is None:
        rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


_install()


@rank_zero_only
def rank_zero_info(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.info(message, *args)`` on global rank zero only."""
    logger.info(message, *args, stacklevel=3)


@rank_zero_only
def rank_zero_warning(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.warning(message, *args)`` on global rank zero only (a message, not a
    `warnings.warn`: use lightning-utilities' ``rank_zero_warn`` for that)."""
    logger.warning(message, *args, stacklevel=3)


@rank_zero_only
def rank_zero_debug(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.debug(message, *args)`` on global rank zero only."""
    logger.debug(message, *args, stacklevel=3)
