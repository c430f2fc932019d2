"""`LearningRateMonitor`: each optimizer's learning rate sent to the loggers, as Lightning names it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["LearningRateMonitor"]


@dataclass
class _Named:
    """An optimizer, the key of each of its parameter groups, and the interval of its
    scheduler (None: it has none)."""

    optimizer: torch.optim.Optimizer
    keys: list[str]
    interval: str | None


class LearningRateMonitor(Callback):
    """Log the learning rate of every optimizer (and parameter group) during fit.

    Keys are Lightning's: ``lr-<OptimizerClass>`` (``lr-SGD``), or the ``name`` of the
    optimizer's ``lr_scheduler`` dict; ``-<N>`` for a second optimizer of the same class;
    with several parameter groups ``/pg<N>`` (or ``/<name>`` of a group that has a
    ``"name"`` key; a single group with a name gets it too). The momentum is logged under
    ``<key>-momentum``, the weight decay under ``<key>-weight_decay``. Values go to the
    Trainer's loggers on global rank zero at the step of the batch about to use them, into
    ``trainer.callback_metrics`` (so a callback may monitor them) and into `lrs` on every
    rank. Optimizers with a scheduler come first, in the schedulers' order, then the
    others, as Lightning numbers them.

    Args:
        logging_interval: ``"step"`` (before each optimizer step's batch, every
            ``log_every_n_steps`` steps), ``"epoch"`` (at each epoch's start), or None
            (each optimizer at its scheduler's interval; one without a scheduler at both).
        log_momentum: also log the momentum (``betas[0]`` for optimizers with ``betas``
            such as Adam, else ``momentum``; 0, with a warning, for an optimizer with
            neither).
        log_weight_decay: also log each parameter group's ``weight_decay``.

    Attributes:
        lrs: every learning rate logged, by key.
        last_momentum_values: the latest momentum logged, by ``<key>-momentum``.
        last_weight_decay_values: the latest weight decay logged, by ``<key>-weight_decay``.
    """

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigurationError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step', "
                "'epoch' or None."
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float] = {}
        self.last_weight_decay_values: dict[str, float] = {}
        self._steps_seen = 0

    def _named(self, trainer: Trainer) -> list[_Named]:
        """The optimizers in Lightning's order (scheduled first), with their keys."""
        seen: list[torch.optim.Optimizer] = []
        counts: Counter[type] = Counter()
        result = []
        for config in trainer.lr_scheduler_configs:
            scheduled: torch.optim.Optimizer | None = getattr(config.scheduler, "optimizer", None)
            if scheduled is None:  # a scheduler of one's own may not say which it steps
                continue
            result.append(
                _Named(
                    scheduled,
                    self._keys(scheduled, config.name, seen, counts),
                    str(config.interval),
                )
            )
        for given in trainer.optimizers:
            # An engine's optimizer (DeepSpeed's) wraps the one the scheduler holds.
            optimizer = getattr(given, "optimizer", given)
            if not any(optimizer is other for other in seen):
                result.append(_Named(optimizer, self._keys(optimizer, None, seen, counts), None))
        return result

    @staticmethod
    def _keys(
        optimizer: torch.optim.Optimizer,
        name: str | None,
        seen: list[torch.optim.Optimizer],
        counts: Counter[type],
    ) -> list[str]:
        seen.append(optimizer)
        kind = type(optimizer)
        if name is None:
            counts[kind] += 1
        base = name if name is not None else f"lr-{kind.__name__}"
        # Lightning numbers a name by how many optimizers of its class came unnamed so far.
        if counts[kind] > 1:
            base = f"{base}-{counts[kind] - 1}"
        groups = optimizer.param_groups
        labels = [group.get("name") for group in groups]
        named = [label for label in labels if label is not None]
        if len(set(named)) != len(named):
            raise ConfigurationError(
                f"{kind.__name__} has parameter groups with the same 'name' ({named}); "
                "LearningRateMonitor logs each group under its name, so give each its own."
            )
        if len(groups) == 1:
            return [f"{base}/{labels[0]}" if labels[0] is not None else base]
        return [
            f"{base}/{label if label is not None else f'pg{number}'}"
            for number, label in enumerate(labels, start=1)
        ]

    def stats(self, trainer: Trainer, interval: str) -> dict[str, float]:
        """The current values of the optimizers logged at ``interval``, keyed as logged."""
        result: dict[str, float] = {}
        for named in self._named(trainer):
            if self.logging_interval is not None:
                if interval != self.logging_interval:
                    continue
            elif named.interval is not None and named.interval != interval:
                continue
            optimizer = named.optimizer
            betas = "betas" in _defaults(optimizer)
            for key, group in zip(named.keys, optimizer.param_groups, strict=True):
                result[key] = float(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if betas else group.get("momentum", 0.0)
                    result[f"{key}-momentum"] = float(momentum)
                if self.log_weight_decay:
                    result[f"{key}-weight_decay"] = float(group.get("weight_decay", 0.0))
        return result

    def _log(self, trainer: Trainer, interval: str) -> None:
        values = self.stats(trainer, interval)
        if not values:
            return
        for key, value in values.items():
            if key.endswith("-momentum"):
                self.last_momentum_values[key] = value
            elif key.endswith("-weight_decay"):
                self.last_weight_decay_values[key] = value
            else:
                self.lrs.setdefault(key, []).append(value)
        device = trainer.strategy.root_device
        trainer.callback_metrics.update(
            {key: torch.tensor(value, device=device) for key, value in values.items()}
        )
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
        optimizers = [named.optimizer for named in self._named(trainer)]
        defaults = [_defaults(o) for o in optimizers]
        if self.log_momentum and any("momentum" not in d and "betas" not in d for d in defaults):
            rank_zero_warn(
                "LearningRateMonitor(log_momentum=True): some optimizers have no momentum "
                "(nor betas); 0 is logged for them.",
                category=RuntimeWarning,
            )
        if self.log_weight_decay and any("weight_decay" not in d for d in defaults):
            rank_zero_warn(
                "LearningRateMonitor(log_weight_decay=True): some optimizers have no "
                "weight_decay; 0 is logged for them.",
                category=RuntimeWarning,
            )

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


def _defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's default hyperparameters (its first group's where it has none)."""
    found: dict[str, Any] = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
    return found
