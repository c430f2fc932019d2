"""The Trainer's arguments checked, and its default callbacks and loggers added."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from accord.callbacks.callback import Callback
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.progress import ProgressBar
from accord.errors import ConfigurationError
from accord.loggers.csv import CSVLogger
from accord.loggers.logger import Logger

__all__ = ["build_callbacks", "build_loggers", "check_limit", "check_positive"]


def check_positive(name: str, value: int) -> None:
    """Refuse anything but an int >= 1 for the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1.")


def check_limit(name: str, value: int | float | None) -> None:
    """Refuse a batch limit that is not None, an int >= 0, or a float fraction in [0, 1]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{name}={value!r} must be an int count, a float fraction, or None."
        )
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ConfigurationError(
            f"{name}={value} is a fraction outside [0, 1]. Pass an int for a number of batches."
        )
    if value < 0:
        raise ConfigurationError(f"{name}={value} must be >= 0.")


def build_callbacks(
    callbacks: Callback | Iterable[Callback] | None, progress: bool, checkpointing: bool
) -> list[Callback]:
    """The user's callbacks, plus a `ProgressBar` and a `ModelCheckpoint` unless given."""
    if callbacks is None:
        result: list[Callback] = []
    elif isinstance(callbacks, Callback):
        result = [callbacks]
    else:
        result = list(callbacks)
    for cb in result:
        if not isinstance(cb, Callback):
            raise ConfigurationError(
                f"callbacks must be accord.callbacks.Callback objects, got {type(cb).__name__}."
            )
    if progress and not any(isinstance(cb, ProgressBar) for cb in result):
        result.append(ProgressBar())
    if checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in result):
        result.append(ModelCheckpoint())
    return result


def build_loggers(logger: Logger | Iterable[Logger] | bool, root: Path) -> list[Logger]:
    """The loggers ``logger=`` asks for: True is a `CSVLogger` under ``root``."""
    if logger is True:
        return [CSVLogger(root)]
    if logger is False:
        return []
    if isinstance(logger, Logger):
        return [logger]
    loggers = list(logger)
    for item in loggers:
        if not isinstance(item, Logger):
            raise ConfigurationError(f"logger must be a Logger, got {type(item).__name__}.")
    return loggers
