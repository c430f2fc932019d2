"""The Trainer's arguments checked, Lightning's debugging flags resolved, and its default
callbacks and loggers added."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from accord.callbacks.callback import Callback
from accord.callbacks.checkpoint import Checkpoint
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.model_summary import ModelSummary
from accord.callbacks.progress import ProgressBar, TQDMProgressBar
from accord.callbacks.timer import Timer
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.log import rank_zero_info
from accord.loggers.csv import CSVLogger
from accord.loggers.logger import Logger
from accord.precision import Precision

log = logging.getLogger(__name__)

__all__ = [
    "BatchLimits",
    "build_callbacks",
    "build_loggers",
    "check_barebones",
    "check_limit",
    "check_model_registry",
    "check_plugins",
    "check_positive",
    "check_profiler",
    "loop_limits",
    "resolve_limits",
]

GRADIENT_CLIP_ALGORITHMS = ("norm", "value")
PROFILERS = ("collectives", "timeline")


def check_positive(name: str, value: int) -> None:
    """Refuse anything but an int >= 1 for the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1.")


def check_non_negative(name: str, value: int) -> None:
    """Refuse anything but an int >= 0 for the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 0.")


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


def check_profiler(profiler: str | None) -> None:
    """Refuse a ``profiler`` accord does not have.

    Raises:
        ConfigurationError: anything but ``"collectives"``, ``"timeline"`` or None
            (Lightning's ``"simple"``, ``"advanced"``, ``"pytorch"`` and profiler objects
            included).
    """
    if profiler is not None and profiler not in PROFILERS:
        raise ConfigurationError(
            f"profiler={profiler!r} is not one of accord's profilers: use 'collectives' (calls "
            "and time of every collective op, per rank) or 'timeline' (a Chrome trace of every "
            "rank's collective calls), or None. For Lightning's 'simple'/'advanced'/'pytorch' "
            "profilers, profile the script with cProfile or torch.profiler directly."
        )


def check_gradient_clipping(value: float | None, algorithm: str | None) -> str:
    """``gradient_clip_algorithm`` resolved (``"norm"`` by default).

    Raises:
        ConfigurationError: a value not above zero, or an unknown algorithm.
    """
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise ConfigurationError(f"gradient_clip_val={value} must be > 0.")
    resolved = "norm" if algorithm is None else str(algorithm).lower()
    if resolved not in GRADIENT_CLIP_ALGORITHMS:
        raise ConfigurationError(
            f"gradient_clip_algorithm={algorithm!r} is not known; use 'norm' (the total norm) "
            "or 'value' (each gradient element clamped)."
        )
    return resolved


@dataclass
class BatchLimits:
    """The batch limits a run uses once the debugging flags are applied.

    Attributes:
        train, val, test, predict: each loader's ``limit_*_batches`` (None: all).
        max_steps, max_epochs: the fit's limits.
        num_sanity_val_steps: validation batches before training (``math.inf``: all).
        val_check_interval, check_val_every_n_epoch: when to validate.
    """

    train: int | float | None
    val: int | float | None
    test: int | float | None
    predict: int | float | None
    max_steps: int
    max_epochs: int | None
    num_sanity_val_steps: float
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None


def resolve_limits(
    limits: BatchLimits, fast_dev_run: int | bool, overfit_batches: int | float
) -> BatchLimits:
    """Apply ``fast_dev_run`` and ``overfit_batches`` to ``limits``, as Lightning does.

    ``fast_dev_run=n`` (True is 1) runs ``n`` batches of each loader, one epoch, at most
    ``n`` steps, no sanity check; ``overfit_batches`` takes that many (or that fraction of)
    training batches, in order, for training and validation.

    Raises:
        ConfigurationError: a negative ``fast_dev_run``, or ``overfit_batches`` out of range.
    """
    if isinstance(fast_dev_run, bool):
        runs = int(fast_dev_run)
    elif isinstance(fast_dev_run, int) and fast_dev_run >= 0:
        runs = fast_dev_run
    else:
        raise ConfigurationError(
            f"fast_dev_run={fast_dev_run!r} must be a bool or an int >= 0 (batches to run)."
        )
    check_limit("overfit_batches", overfit_batches)
    if overfit_batches:
        limits.train = limits.val = overfit_batches
    if runs:
        if not overfit_batches:
            limits.train = limits.val = runs
        limits.test = limits.predict = runs
        limits.max_steps, limits.max_epochs = runs, 1
        limits.num_sanity_val_steps = 0
        limits.val_check_interval, limits.check_val_every_n_epoch = 1.0, 1
        rank_zero_info(
            log,
            "%s",
            f"Running in fast_dev_run mode: {runs} batch(es) of each loader; logging and "
            "checkpointing are off.",
        )
    return limits


def loop_limits(flags: dict[str, Any], sanity: int | None) -> tuple[BatchLimits, int]:
    """The loop's limits and intervals checked, with ``fast_dev_run``/``overfit_batches``
    applied, and how often step metrics go to the loggers (``log_every_n_steps``).

    Args:
        flags: the Trainer's arguments, by name.
        sanity: ``num_sanity_val_steps`` (0 under ``barebones``).

    Raises:
        ConfigurationError: an argument out of range.
    """
    max_epochs, max_steps = flags["max_epochs"], flags["max_steps"]
    check_positive("accumulate_grad_batches", flags["accumulate_grad_batches"])
    every_n = flags["check_val_every_n_epoch"]
    if every_n is not None:
        check_positive("check_val_every_n_epoch", every_n)
    log_every = 50 if flags["log_every_n_steps"] is None else flags["log_every_n_steps"]
    check_non_negative("log_every_n_steps", log_every)
    check_non_negative(
        "reload_dataloaders_every_n_epochs", flags["reload_dataloaders_every_n_epochs"]
    )
    if max_epochs is not None and max_epochs < -1:
        raise ConfigurationError(f"max_epochs={max_epochs} must be -1 (no limit), >= 0 or None.")
    if max_steps < -1:
        raise ConfigurationError(f"max_steps={max_steps} must be -1 (no limit) or >= 0.")
    for name in ("min_epochs", "min_steps"):
        if flags[name] is not None:
            check_non_negative(name, flags[name])
    limits = BatchLimits(
        train=flags["limit_train_batches"],
        val=flags["limit_val_batches"],
        test=flags["limit_test_batches"],
        predict=flags["limit_predict_batches"],
        max_steps=max_steps,
        max_epochs=1000 if max_epochs is None and max_steps == -1 else max_epochs,
        num_sanity_val_steps=sanity_steps(sanity),
        val_check_interval=flags["val_check_interval"],
        check_val_every_n_epoch=every_n,
    )
    for name in ("train", "val", "test", "predict"):
        check_limit(f"limit_{name}_batches", getattr(limits, name))
    check_limit("val_check_interval", limits.val_check_interval)
    limits = resolve_limits(limits, flags["fast_dev_run"], flags["overfit_batches"])
    return limits, log_every


def sanity_steps(value: int | None) -> float:
    """``num_sanity_val_steps`` as a count (``-1``: every batch; None: Lightning's 2).

    Raises:
        ConfigurationError: anything but None, -1 or an int >= 0.
    """
    if value is None:
        return 2
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ConfigurationError(
            f"num_sanity_val_steps={value!r} must be -1 (all batches), 0 (no sanity check) or "
            "a number of validation batches."
        )
    return math.inf if value == -1 else value


def check_model_registry(model_registry: str | None) -> None:
    """Refuse a ``model_registry``: accord has none."""
    if model_registry is not None:
        raise ConfigurationError(
            f"model_registry={model_registry!r}: accord has no model registry. Save with "
            "ModelCheckpoint and upload the files with your registry's own client."
        )


def check_barebones(options: dict[str, Any]) -> None:
    """Refuse what ``barebones=True`` turns off, when it was asked for explicitly.

    ``options`` maps each such Trainer argument to the value passed (None: not passed).

    Raises:
        ConfigurationError: one of them set to turn its feature on.
    """
    on = {
        "enable_checkpointing": options["enable_checkpointing"] is True,
        "logger": options["logger"] not in (None, False),
        "enable_progress_bar": options["enable_progress_bar"] is True,
        "log_every_n_steps": options["log_every_n_steps"] not in (None, 0),
        "enable_model_summary": options["enable_model_summary"] is True,
        "num_sanity_val_steps": options["num_sanity_val_steps"] not in (None, 0),
        "fast_dev_run": options["fast_dev_run"] not in (False, 0),
        "detect_anomaly": bool(options["detect_anomaly"]),
        "profiler": options["profiler"] is not None,
    }
    for name, enabled in on.items():
        if enabled:
            raise ConfigurationError(
                f"Trainer(barebones=True, {name}={options[name]!r}): barebones mode turns off "
                f"everything that costs speed, {name} included. Drop one of the two."
            )


def check_plugins(plugins: Any) -> tuple[Precision | None, ClusterEnvironment | None]:
    """The precision and cluster environment given as ``plugins=``.

    accord takes a `Precision` and a `ClusterEnvironment` there; Lightning's other plugins
    (checkpoint IO, layer sync, custom precision plugins) have no accord counterpart.

    Raises:
        ConfigurationError: any other plugin, or two of one kind.
    """
    if plugins is None:
        return None, None
    items = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
    precision: Precision | None = None
    environment: ClusterEnvironment | None = None
    for item in items:
        if isinstance(item, Precision) and precision is None:
            precision = item
        elif isinstance(item, ClusterEnvironment) and environment is None:
            environment = item
        else:
            raise ConfigurationError(
                f"plugins= got {item!r}, which accord cannot use: it takes one "
                "accord.precision.Precision and one accord ClusterEnvironment. For a precision "
                "pass precision='bf16-mixed' etc.; for gradient sync of BatchNorm "
                "sync_batchnorm=True; for checkpoint IO, accord writes checkpoints atomically "
                "itself (see docs/checkpoints.md)."
            )
    return precision, environment


def build_callbacks(
    callbacks: Callback | Iterable[Callback] | None,
    *,
    progress: bool,
    checkpointing: bool,
    model_summary: bool,
    max_time: str | timedelta | dict[str, int] | None,
) -> list[Callback]:
    """The user's callbacks, plus what the flags add unless given: a `ModelSummary`, a
    `TQDMProgressBar` (unless a `ProgressBar` is given), a `Timer` for ``max_time`` and a
    `ModelCheckpoint` (unless a `Checkpoint` is given; last, as Lightning orders
    checkpoint callbacks)."""
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
    if model_summary and not any(isinstance(cb, ModelSummary) for cb in result):
        result.append(ModelSummary())
    if progress and not any(isinstance(cb, ProgressBar) for cb in result):
        result.append(TQDMProgressBar())
    if max_time is not None:
        result.append(Timer(duration=max_time, interval="step", verbose=True))
    if checkpointing and not any(isinstance(cb, Checkpoint) for cb in result):
        result.append(ModelCheckpoint())
    return checkpoints_last(result)


def checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the checkpoint callbacks moved to the end, as Lightning runs them
    (so a checkpoint holds what every other callback did at that point)."""
    others = [cb for cb in callbacks if not isinstance(cb, Checkpoint)]
    return others + [cb for cb in callbacks if isinstance(cb, Checkpoint)]


def build_loggers(logger: Logger | Iterable[Logger] | bool | None, root: Path) -> list[Logger]:
    """The loggers ``logger=`` asks for: True (or None) is a `CSVLogger` under ``root``."""
    if logger is True or logger is None:
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
