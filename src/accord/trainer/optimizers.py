"""Optimizers and LR schedulers: ``configure_optimizers``'s forms made one, and their steps."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from accord.errors import ConfigurationError
from accord.module import Module

__all__ = [
    "SchedulerConfig",
    "configure_optimizers",
    "due_schedulers",
    "monitored_value",
    "step_schedulers",
]

_INTERVALS = ("epoch", "step")


@dataclass
class SchedulerConfig:
    """One LR scheduler and when it steps, as an ``lr_scheduler`` dict describes it.

    Attributes:
        scheduler: the scheduler (anything with ``step()``, ``state_dict()`` and
            ``load_state_dict()``).
        name: the name `LearningRateMonitor` logs it under (None: derived from the
            optimizer).
        interval: ``"epoch"`` (at the end of each training epoch) or ``"step"`` (after
            each optimizer step).
        frequency: step it every this many epochs or batches.
        reduce_on_plateau: it steps with a monitored metric (``ReduceLROnPlateau``); such
            a scheduler steps after ``on_train_epoch_end``, the others right after the
            epoch's last optimizer step, as in Lightning.
        monitor: the logged metric passed to ``step()``, or None.
        strict: a missing ``monitor`` is an error (False: a warning, and no step).
        opt_idx: accepted for Lightning's dict; unused.
    """

    scheduler: Any
    name: str | None = None
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: str | None = None
    strict: bool = True
    opt_idx: int | None = None


_CONFIG_KEYS = {f.name for f in fields(SchedulerConfig)}


def _scheduler_config(item: Any, monitor: str | None) -> SchedulerConfig:
    """The `SchedulerConfig` of a bare scheduler or an ``lr_scheduler`` dict; ``monitor`` is
    the optimizer dict's own ``"monitor"`` key, for a bare ``ReduceLROnPlateau``."""
    if not isinstance(item, Mapping):
        plateau = isinstance(item, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and monitor is None:
            raise ConfigurationError(
                "configure_optimizers() returned a ReduceLROnPlateau without a metric to "
                "monitor; return {'optimizer': opt, 'lr_scheduler': scheduler, 'monitor': "
                "'val_loss'}."
            )
        return SchedulerConfig(
            item, reduce_on_plateau=plateau, monitor=monitor if plateau else None
        )
    if "scheduler" not in item:
        raise ConfigurationError("An lr_scheduler dict needs a 'scheduler' key.")
    unknown = set(item) - _CONFIG_KEYS
    if unknown:
        raise ConfigurationError(
            f"The lr_scheduler dict has keys accord does not know: {sorted(unknown)}; use "
            f"{sorted(_CONFIG_KEYS)}."
        )
    config = SchedulerConfig(**item)
    if config.interval not in _INTERVALS:
        raise ConfigurationError(
            f"lr_scheduler interval {config.interval!r}: use 'epoch' or 'step'."
        )
    if "reduce_on_plateau" not in item:
        config.reduce_on_plateau = isinstance(
            config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        )
    if config.reduce_on_plateau and config.monitor is None:
        config.monitor = monitor
        if monitor is None:
            raise ConfigurationError(
                "The lr_scheduler dict of a ReduceLROnPlateau needs a 'monitor' key (the "
                "logged metric to step with), e.g. {'scheduler': s, 'monitor': 'val_loss'}."
            )
    return config


def configure_optimizers(
    model: Module,
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Call ``model.configure_optimizers()`` and normalise every form it may return.

    Raises:
        ConfigurationError: a form it does not know, or no optimizer at all.
    """
    config = model.configure_optimizers()
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[SchedulerConfig] = []

    def add(item: Any) -> None:
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, Mapping) and "optimizer" in item:
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(_scheduler_config(item["lr_scheduler"], item.get("monitor")))
        else:
            raise ConfigurationError(
                f"configure_optimizers() returned {type(item).__name__}. Return an optimizer, "
                "a list of them, (optimizers, schedulers), or {'optimizer': ..., "
                "'lr_scheduler': ...}."
            )

    if (
        isinstance(config, tuple | list)
        and len(config) == 2
        and isinstance(config[0], list | tuple)
        and isinstance(config[1], list | tuple)
    ):
        for item in config[0]:
            add(item)
        schedulers.extend(_scheduler_config(item, None) for item in config[1])
    elif isinstance(config, list | tuple):
        for item in config:
            add(item)
    else:
        add(config)
    if not optimizers:
        raise ConfigurationError("configure_optimizers() returned no optimizer.")
    return optimizers, schedulers


def due_schedulers(
    schedulers: list[SchedulerConfig], interval: str, index: int, plateau: bool | None
) -> list[SchedulerConfig]:
    """The ``interval`` schedulers due at ``index`` (the batch index + 1 for ``"step"``, the
    epoch + 1 for ``"epoch"``, as Lightning counts); ``plateau`` picks the monitored ones
    (True), the others (False) or all (None)."""
    return [
        config
        for config in schedulers
        if config.interval == interval
        and index % config.frequency == 0
        and (plateau is None or config.reduce_on_plateau == plateau)
    ]


def monitored_value(config: SchedulerConfig, metrics: Mapping[str, Any]) -> float | None:
    """The value ``config`` steps with: its monitored metric, or None for a plain scheduler.

    Raises:
        ConfigurationError: a ``strict`` scheduler's metric was not logged.
    """
    if config.monitor is None:
        return None
    value = metrics.get(config.monitor)
    if value is None:
        if config.strict:
            raise ConfigurationError(
                f"The LR scheduler monitors {config.monitor!r}, which was not logged. Logged: "
                f"{sorted(metrics)}. Log it, or set 'strict': False in the lr_scheduler dict."
            )
        warnings.warn(
            f"The LR scheduler monitors {config.monitor!r}, which was not logged, and is "
            "not strict: it did not step.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return float(value)


def step_schedulers(
    schedulers: list[SchedulerConfig], interval: str, count: int, metrics: Mapping[str, Any]
) -> None:
    """Step every ``interval`` scheduler due at ``count`` (a resumed checkpoint's epoch
    schedulers that had not stepped yet).

    Raises:
        ConfigurationError: a monitored metric is not in ``metrics``.
    """
    for config in due_schedulers(schedulers, interval, count, None):
        value = monitored_value(config, metrics)
        if config.monitor is not None and value is None:
            continue
        config.scheduler.step() if value is None else config.scheduler.step(value)
