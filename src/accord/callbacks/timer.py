"""`Timer`: stop a fit after a wall-clock budget, every rank at the same step."""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError
from accord.log import rank_zero_info

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = ["Timer"]

_DURATION = re.compile(r"^(\d+):(\d\d):(\d\d):(\d\d)$")
# Lightning's stage names; it measures the first three.
_STAGES = ("train", "validate", "test", "predict", "sanity_check")


def _stage(stage: str) -> str:
    if stage not in _STAGES:
        raise ConfigurationError(
            f"Timer(...).time_elapsed(stage={stage!r}): use one of {list(_STAGES)}."
        )
    return stage


def _parse(duration: str | timedelta | dict[str, int] | None) -> timedelta | None:
    if duration is None or isinstance(duration, timedelta):
        return duration
    if isinstance(duration, dict):
        try:
            return timedelta(**duration)
        except TypeError as err:
            raise ConfigurationError(
                f"Timer(duration={duration!r}): {err}; use timedelta's keys (days, hours, "
                "minutes, seconds)."
            ) from None
    match = _DURATION.match(str(duration))
    if match is None:
        raise ConfigurationError(
            f"Timer(duration={duration!r}): write it as 'DD:HH:MM:SS' (e.g. '00:12:00:00'), "
            "a timedelta, or a dict such as {'hours': 12}."
        )
    days, hours, minutes, seconds = (int(part) for part in match.groups())
    return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)


class Timer(Callback):
    """Track the fit's training time and stop it once ``duration`` has passed.

    The check runs after every training batch (``interval="step"``) or epoch
    (``interval="epoch"``). Each rank reads its own clock, and the ranks agree through
    ``strategy.reduce_boolean_decision(over_budget, all=False)``: once any rank is over
    budget every rank stops after the same batch. The training time is saved in
    checkpoints, so a resumed fit counts from where it was. As Lightning's, it also
    measures validation and test runs (`time_elapsed` takes the stage).

    Args:
        duration: the budget: ``"DD:HH:MM:SS"``, a `datetime.timedelta`, a dict of
            timedelta's keys, or None (only measure).
        interval: ``"step"`` or ``"epoch"``.
        verbose: say on rank zero when the budget stops the fit.
    """

    def __init__(
        self,
        duration: str | timedelta | dict[str, int] | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise ConfigurationError(f"Timer(interval={interval!r}): use 'step' or 'epoch'.")
        budget = _parse(duration)
        if budget is not None and budget.total_seconds() <= 0:
            raise ConfigurationError(f"Timer(duration={duration!r}) must be longer than zero.")
        self.duration = budget
        self.interval = interval
        self.verbose = verbose
        self._offset = 0.0
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` (``"train"``, ``"validate"`` or ``"test"``; ``"predict"`` and
        ``"sanity_check"`` are not measured, as in Lightning) last started, in
        `time.monotonic` seconds, or None."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended, in `time.monotonic` seconds, or None."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage``'s last run; for ``"train"`` (the default) including a
        resumed checkpoint's training time."""
        stage = _stage(stage)
        offset = self._offset if stage == "train" else 0.0
        start, end = self._start[stage], self._end[stage]
        if start is None:
            return offset
        return offset + (end if end is not None else time.monotonic()) - start

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of the budget (None without one)."""
        if self.duration is None:
            return None
        return self.duration.total_seconds() - self.time_elapsed(stage)

    def _mark(self, table: dict[str, float | None], stage: str) -> None:
        table[stage] = time.monotonic()
        if table is self._start:
            self._end[stage] = None

    @override
    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._start, "train")

    @override
    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._end, "train")

    @override
    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._start, "validate")

    @override
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._end, "validate")

    @override
    def on_test_start(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._start, "test")

    @override
    def on_test_end(self, trainer: Trainer, module: Module) -> None:
        self._mark(self._end, "test")

    def _check(self, trainer: Trainer) -> None:
        remaining = self.time_remaining()
        if remaining is None:
            return
        if trainer.strategy.reduce_boolean_decision(remaining <= 0, all=False):
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                rank_zero_info(
                    log,
                    "%s",
                    f"Timer: the {self.duration} budget is spent; training stops at step "
                    f"{trainer.global_step}.",
                )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.interval == "step":
            self._check(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self.interval == "epoch":
            self._check(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": self.time_elapsed()}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", 0.0))
        if self._start["train"] is not None:
            self._start["train"] = time.monotonic()
