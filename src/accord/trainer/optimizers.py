"""Optimizers and LR schedulers: ``configure_optimizers``'s forms made one, and their steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accord.core.strategy import Strategy
from accord.errors import ConfigurationError
from accord.module import Module

__all__ = ["SchedulerConfig", "configure_optimizers", "optimizer_step", "step_schedulers"]

_INTERVALS = ("epoch", "step")


@dataclass
class SchedulerConfig:
    """One LR scheduler and when it steps, as an ``lr_scheduler`` dict describes it.

    Attributes:
        scheduler: the scheduler (anything with ``step()``, ``state_dict()`` and
            ``load_state_dict()``).
        interval: ``"epoch"`` (after each training epoch) or ``"step"`` (after each
            optimizer step).
        frequency: step it every this many epochs or optimizer steps.
        monitor: the logged metric passed to ``step()`` (``ReduceLROnPlateau``), or None.
    """

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


def _scheduler_config(item: Any) -> SchedulerConfig:
    if not isinstance(item, Mapping):
        return SchedulerConfig(item)
    if "scheduler" not in item:
        raise ConfigurationError("An lr_scheduler dict needs a 'scheduler' key.")
    interval = item.get("interval", "epoch")
    if interval not in _INTERVALS:
        raise ConfigurationError(f"lr_scheduler interval {interval!r}: use 'epoch' or 'step'.")
    return SchedulerConfig(
        item["scheduler"], interval, item.get("frequency", 1), item.get("monitor")
    )


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
                schedulers.append(_scheduler_config(item["lr_scheduler"]))
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
        schedulers.extend(_scheduler_config(item) for item in config[1])
    elif isinstance(config, list | tuple):
        for item in config:
            add(item)
    else:
        add(config)
    if not optimizers:
        raise ConfigurationError("configure_optimizers() returned no optimizer.")
    return optimizers, schedulers


def step_schedulers(
    schedulers: list[SchedulerConfig], interval: str, count: int, metrics: Mapping[str, Any]
) -> None:
    """Step the ``interval`` schedulers due at ``count`` (optimizer steps or epochs done).

    A scheduler with a ``monitor`` steps with that metric's value from ``metrics``.

    Raises:
        ConfigurationError: a monitored metric is not in ``metrics``.
    """
    for config in schedulers:
        if config.interval != interval or count % config.frequency:
            continue
        if config.monitor is None:
            config.scheduler.step()
            continue
        value = metrics.get(config.monitor)
        if value is None:
            raise ConfigurationError(
                f"The LR scheduler monitors {config.monitor!r}, which was not logged. Logged: "
                f"{sorted(metrics)}."
            )
        config.scheduler.step(float(value))


def optimizer_step(
    strategy: Strategy,
    model: Module,
    wrapped: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    gradient_clip_val: float | None,
) -> None:
    """Apply every optimizer once: clip (or unscale), the hook, the step, zero_grad."""
    for optimizer in optimizers:
        if gradient_clip_val is not None:
            strategy.clip_gradients(wrapped, optimizer, gradient_clip_val)
        else:
            # So on_before_optimizer_step sees the true gradients under a loss scaler.
            strategy.unscale_gradients(optimizer)
        model.on_before_optimizer_step(optimizer)
        strategy.optimizer_step(optimizer, wrapped)
        strategy.zero_grad(optimizer, wrapped)
