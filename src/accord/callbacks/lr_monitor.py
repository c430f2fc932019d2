"""`LearningRateMonitor`: each optimizer's learning rate sent to the loggers, as Lightning names it."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["LearningRateMonitor"]


class LearningRateMonitor(Callback):
    """Log the learning rate of every optimizer (and parameter group) during fit.

    Keys are Lightning's: ``lr-<OptimizerClass>`` (``lr-SGD``), with ``/pg<N>`` for an
    optimizer with several parameter groups and ``-<N>`` for a second optimizer of the
    same class; ``momentum-...`` likewise with ``log_momentum=True``. Values go to the
    Trainer's loggers on global rank zero at the step of the batch about to use them, and
    into `lrs` on every rank.

    Args:
        logging_interval: ``"step"`` (before each optimizer step's batch, every
            ``log_every_n_steps`` steps), ``"epoch"`` (at each epoch's start), or None
            (each optimizer at its scheduler's interval; one without a scheduler every step).
        log_momentum: also log the momentum (``momentum``, or ``betas[0]`` for Adam-like
            optimizers).
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigurationError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step', "
                "'epoch' or None."
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.lrs: dict[str, list[float]] = {}
        self._steps_seen = 0

    def _interval_of(self, trainer: Trainer, index: int) -> str:
        if self.logging_interval is not None:
            return self.logging_interval
        optimizer = trainer.optimizers[index]
        for config in trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is optimizer:
                return str(config.interval)
        return "step"

    def _names(self, optimizers: list[torch.optim.Optimizer]) -> list[str]:
        seen: Counter[str] = Counter()
        names = []
        for optimizer in optimizers:
            base = type(optimizer).__name__
            names.append(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
        return names

    def stats(self, trainer: Trainer, interval: str) -> dict[str, float]:
        """The current values of the optimizers logged at ``interval``, keyed as logged."""
        result: dict[str, float] = {}
        optimizers = trainer.optimizers
        for index, (name, optimizer) in enumerate(
            zip(self._names(optimizers), optimizers, strict=True)
        ):
            if self._interval_of(trainer, index) != interval:
                continue
            groups = optimizer.param_groups
            for number, group in enumerate(groups):
                suffix = f"/pg{number + 1}" if len(groups) > 1 else ""
                result[f"lr-{name}{suffix}"] = float(group["lr"])
                if self.log_momentum:
                    momentum = _momentum(group)
                    if momentum is not None:
                        result[f"momentum-{name}{suffix}"] = momentum
        return result

    def _log(self, trainer: Trainer, interval: str) -> None:
        values = self.stats(trainer, interval)
        if not values:
            return
        for key, value in values.items():
            self.lrs.setdefault(key, []).append(value)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, trainer.global_step)

    @override
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        if not trainer.loggers:
            raise ConfigurationError(
                "LearningRateMonitor needs a logger to write to, and this Trainer has none "
                "(logger=False). Pass logger=True or a Logger, or drop the callback."
            )
        self._steps_seen = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._log(trainer, "epoch")
        if (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self._log(trainer, "step")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._steps_seen
        self._steps_seen = trainer.global_step
        # The values the next batch of this epoch steps with, logged at its step.
        more = batch_idx + 1 < trainer.num_training_batches and (
            trainer.max_steps == -1 or trainer.global_step < trainer.max_steps
        )
        if stepped and more and (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self._log(trainer, "step")


def _momentum(group: dict[str, Any]) -> float | None:
    if "momentum" in group:
        return float(group["momentum"])
    if "betas" in group:
        return float(group["betas"][0])
    return None
