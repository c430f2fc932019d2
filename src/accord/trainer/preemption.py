"""Preemption: a signal on any rank stops every rank at the same step, after one checkpoint.

A signal handler only records that the signal came. The fit loop folds that record into
the decision the ranks take together at every step (`accord.trainer.step_decision`); once
they agree, every rank saves the same checkpoint through `Trainer.save_checkpoint`, global
rank zero asks the cluster environment to requeue the job, and the fit raises `Preempted`,
which exits the process with `PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from accord.errors import ConfigurationError, Preempted

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "DEFAULT_PREEMPTION_SIGNALS",
    "PREEMPTION_CHECKPOINT_NAME",
    "SignalFlag",
    "SignalLike",
    "parse_signals",
    "preemption_checkpoint_path",
    "save_and_stop",
]

_log = logging.getLogger(__name__)

SignalLike = int | str | signal.Signals
"""A signal as ``signal.SIGTERM``, its number, or its name (``"SIGUSR1"`` or ``"USR1"``)."""

DEFAULT_PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)
"""The signals a fit treats as preemption unless told otherwise."""

PREEMPTION_CHECKPOINT_NAME = "preempted.ckpt"
"""The file (or directory, for sharded strategies) the preemption checkpoint is saved as,
in the first `ModelCheckpoint`'s directory (``<default_root_dir>/checkpoints`` without
one)."""

# Signals that cannot be caught, or that a handler must not take over.
_REFUSED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGFPE, signal.SIGILL}


def parse_signals(value: SignalLike | Iterable[SignalLike] | None) -> tuple[signal.Signals, ...]:
    """``value`` as a tuple of distinct signals; None or an empty list means none.

    Raises:
        ConfigurationError: an unknown name or number, or a signal no handler may catch.
    """
    if value is None:
        return ()
    if isinstance(value, int | str) or not isinstance(value, Iterable):
        items: list[Any] = [value]
    else:
        items = list(value)
    result: list[signal.Signals] = []
    for item in items:
        sig = _one_signal(item)
        if sig not in result:
            result.append(sig)
    return tuple(result)


def _one_signal(item: Any) -> signal.Signals:
    try:
        if isinstance(item, str):
            name = item.strip().upper()
            sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        elif isinstance(item, int) and not isinstance(item, bool):
            sig = signal.Signals(item)
        else:
            raise TypeError(item)
    except (KeyError, ValueError, TypeError):
        raise ConfigurationError(
            f"preemption_signals: {item!r} is not a signal. Use names such as 'SIGTERM' or "
            "'SIGUSR1', signal.SIGTERM, or their numbers."
        ) from None
    if sig in _REFUSED:
        raise ConfigurationError(
            f"preemption_signals: {sig.name} cannot be handled by a program (or must not be). "
            "Use SIGTERM, SIGUSR1, SIGUSR2, SIGINT or SIGHUP."
        )
    return sig


class SignalFlag:
    """Records the first of ``signals`` this process receives, while installed.

    The handler only sets `received`, then calls the handler it replaced when that was a
    Python function (a launcher's forwarder, the user's own), but not Python's default
    SIGINT handler, which would raise `KeyboardInterrupt` instead of a clean stop.
    Handlers go in from the main thread only (Python allows no other); elsewhere
    `install` does nothing and returns False.

    Args:
        signals: the signals to catch.
    """

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def received_sigterm(self) -> bool:
        """Whether the signal received is SIGTERM (`Trainer.received_sigterm`)."""
        return self.received is signal.SIGTERM

    def install(self) -> bool:
        """Catch the signals from now on; whether the handlers were installed."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)


def preemption_checkpoint_path(trainer: Trainer) -> Path:
    """Where the preemption checkpoint goes: `PREEMPTION_CHECKPOINT_NAME` in the first
    `ModelCheckpoint`'s directory, else in ``<default_root_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath is not None:
        directory = Path(callback.dirpath)
    else:
        directory = Path(trainer.default_root_dir) / "checkpoints"
    return directory / PREEMPTION_CHECKPOINT_NAME


def save_and_stop(
    trainer: Trainer, ranks: tuple[int, ...], received: signal.Signals | None
) -> NoReturn:
    """Save the preemption checkpoint on every rank, requeue on rank zero, raise `Preempted`.

    Every rank calls it in the same step (the ranks agreed to). ``ranks`` are the ranks
    that received a preemption signal, ``received`` the signal this rank saw, if any.
    """
    path = preemption_checkpoint_path(trainer)
    name = received.name if received is not None else "a preemption signal"
    where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    strategy = trainer.strategy
    if trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
    strategy.barrier("preemption_checkpoint")
    trainer.save_checkpoint(path)
    step = trainer.global_step
    if trainer.is_global_zero:
        _log.info(
            "%s reached %s: every rank stopped at step %d; checkpoint saved to %r.",
            name,
            where,
            step,
            str(path),
        )
        environment = strategy.cluster_environment
        if environment is not None:
            requeued = environment.requeue()
            _log.info(
                "%s: the job was %s.",
                type(environment).__name__,
                "requeued" if requeued else "not requeued",
            )
    raise Preempted(str(path), step, f"{name} on {where}")
