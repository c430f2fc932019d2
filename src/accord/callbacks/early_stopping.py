"""`EarlyStopping`: stop when a monitored metric stops improving — on every rank together."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    Each rank judges its own value, then the ranks agree through
    ``strategy.reduce_boolean_decision(should_stop, all=False)``: if any rank wants to
    stop, every rank stops, at the same epoch, so none is left waiting for the others.

    Args:
        monitor: the logged metric to watch (e.g. ``"val_loss"``).
        min_delta: the smallest change that counts as an improvement.
        patience: checks without improvement before stopping.
        mode: ``"min"`` or ``"max"``.
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is at least this good.
        check_on_train_epoch_end: check at the end of the training epoch instead of after
            validation (default, as in Lightning: at the epoch's end, unless validation
            runs more than once an epoch or not every epoch).
        strict: raise when ``monitor`` was never logged.
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        mode: str = "min",
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        strict: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigurationError(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'.")
        if patience < 0:
            raise ConfigurationError(f"EarlyStopping(patience={patience}) must be >= 0.")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = mode
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.strict = strict
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.stop_reason: str | None = None

    @property
    @override
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def _check_on_train_end(self, trainer: Trainer) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        # Lightning's rule: at the epoch's end unless validation runs more than once an
        # epoch, or not every epoch (then after validation).
        return trainer.val_check_interval in (None, 1.0) and trainer.check_val_every_n_epoch == 1

    @override
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if (
            trainer.stage == "fit"
            and not trainer.sanity_checking
            and not self._check_on_train_end(trainer)
        ):
            self._check(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._check_on_train_end(trainer):
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        metric = trainer.callback_metrics.get(self.monitor)
        if metric is None:
            if self.strict:
                known = sorted(trainer.callback_metrics)
                raise ConfigurationError(
                    f"EarlyStopping monitors {self.monitor!r}, which was not logged. Logged "
                    f"metrics: {known}. Log it with self.log({self.monitor!r}, ...) or fix "
                    "the name."
                )
            return
        value = float(metric)
        reason = self._local_decision(value)
        # Any rank's stop stops all: one all_reduce, the same answer everywhere.
        should_stop = trainer.strategy.reduce_boolean_decision(reason is not None, all=False)
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stop_reason = reason or "another rank asked to stop"

    def _local_decision(self, value: float) -> str | None:
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} = {value} is not finite"
        if self.stopping_threshold is not None and (
            value <= self.stopping_threshold
            if self.mode == "min"
            else value >= self.stopping_threshold
        ):
            return f"{self.monitor} = {value:.6g} reached the threshold {self.stopping_threshold}"
        if self._improved(value):
            self.best_score = value
            self.wait_count = 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (
                f"{self.monitor} did not improve for {self.wait_count} checks "
                f"(best {self.best_score:.6g})"
            )
        return None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score,
            "stopped_epoch": self.stopped_epoch,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.best_score = float(state["best_score"])
        self.stopped_epoch = int(state["stopped_epoch"])
