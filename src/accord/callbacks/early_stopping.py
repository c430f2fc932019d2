"""`EarlyStopping`: stop when a monitored metric stops improving — on every rank together."""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_prefixed_message, rank_zero_warn
from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["EarlyStopping", "EarlyStoppingReason"]

log = logging.getLogger(__name__)


class EarlyStoppingReason(Enum):
    """Why `EarlyStopping` stopped the fit (Lightning's values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    Each rank judges its own value, then the ranks agree through
    ``strategy.reduce_boolean_decision(should_stop, all=False)``: if any rank wants to
    stop, every rank stops, at the same epoch, so none is left waiting for the others.
    The arguments are Lightning's, in Lightning's order.

    Args:
        monitor: the logged metric to watch (e.g. ``"val_loss"``).
        min_delta: the change that counts as an improvement must be larger than this.
        patience: checks without improvement before stopping.
        verbose: log each improvement and the reason for stopping, at INFO level,
            through the ``accord.callbacks.early_stopping`` logger (Python's `logging`);
            with several ranks each message starts with ``[rank: N]``. Also warn when a
            ``strict=False`` monitor is missing.
        mode: ``"min"`` or ``"max"``.
        strict: raise when ``monitor`` was never logged (False: skip the check).
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of the training epoch instead of after
            validation (default, as in Lightning: at the epoch's end, unless validation
            runs more than once an epoch or not every epoch).
        log_rank_zero_only: with ``verbose``, log on global rank zero only.

    Attributes:
        stopped_epoch: the epoch the fit stopped at (0 while it has not stopped).
        stopping_reason: an `EarlyStoppingReason`, this rank's own reason.
        stopping_reason_message: why the fit stopped, in words (``"another rank asked
            to stop"`` on a rank whose own value did not ask), or None.
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigurationError(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'.")
        if patience < 0:
            raise ConfigurationError(f"EarlyStopping(patience={patience}) must be >= 0.")
        self.monitor = monitor
        self.min_delta = min_delta
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    @override
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

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
        if trainer.fast_dev_run:
            return
        metric = trainer.callback_metrics.get(self.monitor)
        if metric is None:
            message = (
                f"EarlyStopping monitors {self.monitor!r}, which was not logged. Logged "
                f"metrics: {sorted(trainer.callback_metrics)}. Log it with "
                f"self.log({self.monitor!r}, ...) or fix the name."
            )
            if self.strict:
                raise ConfigurationError(message)
            if self.verbose:
                rank_zero_warn(message, category=RuntimeWarning)
            return
        reason, stop = self._judge(float(metric))
        # Any rank's stop stops all: one all_reduce, the same answer everywhere.
        should_stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason if stop else "another rank asked to stop"
        if reason is not None and self.verbose:
            self._log(trainer, reason)

    def _judge(self, value: float) -> tuple[str | None, bool]:
        """This rank's verdict on ``value``: what to say (None: nothing) and whether to stop."""
        name = self.monitor
        if self.check_finite and not math.isfinite(value):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return f"{name} = {value} is not finite (best so far {self.best_score:.6g}).", True
        sign = "<" if self.mode == "min" else ">"
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return (
                f"{name} = {value:.6g} {sign} stopping_threshold {self.stopping_threshold}.",
                True,
            )
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return (
                f"{name} = {value:.6g} is worse than divergence_threshold "
                f"{self.divergence_threshold}.",
                True,
            )
        # Lightning's test: better by more than min_delta (a negative one lets a slightly
        # worse value count).
        shifted = value + self.min_delta if self.mode == "min" else value - self.min_delta
        if self._better(shifted, self.best_score):
            previous, self.best_score, self.wait_count = self.best_score, value, 0
            gain = f" by {abs(previous - value):.6g}" if math.isfinite(previous) else ""
            return f"{name} improved{gain} to {value:.6g}.", False
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return (
                f"{name} did not improve for {self.wait_count} checks (best "
                f"{self.best_score:.6g}).",
                True,
            )
        return None, False

    def _log(self, trainer: Trainer, message: str) -> None:
        several = trainer.world_size > 1
        if self.log_rank_zero_only and several and not trainer.is_global_zero:
            return
        text = f"EarlyStopping: {message}" + (" The fit stops." if trainer.should_stop else "")
        log.info(rank_prefixed_message(text, trainer.global_rank if several else None))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score,
            "stopped_epoch": self.stopped_epoch,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.best_score = float(state["best_score"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
