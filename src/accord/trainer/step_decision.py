"""The decision every rank takes together once per training batch, in one collective.

Three questions share one ``all_reduce(sum)`` of an integer vector with a slot per rank:
did a rank skip the batch (``training_step`` returned None), was a rank's loss NaN or
infinite, and did a rank receive a preemption signal. Each rank writes its answers as
bits into its own slot, so the sum tells every rank which ranks said what, and a plain
step makes the same single round trip it made for the skip decision alone.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from accord.core.strategy import Strategy
from accord.errors import ConfigurationError, NonFiniteValueError

__all__ = ["NONFINITE_MODES", "StepDecision", "check_nonfinite_mode", "decide_step", "on_nonfinite"]

NONFINITE_MODES = ("raise", "skip_step", "warn")
"""What ``Trainer(on_nonfinite=...)`` accepts."""

_SKIP, _NONFINITE, _SIGNAL = 1, 2, 4


def check_nonfinite_mode(mode: str) -> str:
    """Return ``mode`` if it is one of `NONFINITE_MODES`.

    Raises:
        ConfigurationError: any other value.
    """
    if mode not in NONFINITE_MODES:
        raise ConfigurationError(
            f"on_nonfinite={mode!r} is not known; use one of {', '.join(NONFINITE_MODES)}."
        )
    return mode


@dataclass(frozen=True)
class StepDecision:
    """What the ranks agreed on for one batch; the same on every rank.

    Attributes:
        skip: some rank's ``training_step`` returned None, so no rank runs backward.
        nonfinite_ranks: the global ranks whose loss was NaN or infinite.
        preempt_ranks: the global ranks that received a preemption signal.
    """

    skip: bool
    nonfinite_ranks: tuple[int, ...]
    preempt_ranks: tuple[int, ...]

    @property
    def preempt(self) -> bool:
        """Whether any rank received a preemption signal."""
        return bool(self.preempt_ranks)


def decide_step(
    strategy: Strategy, loss: torch.Tensor | None, check_loss: bool, signalled: bool
) -> StepDecision:
    """Agree with the other ranks on this batch (every rank must call it, once per batch).

    ``check_loss``: whether to look for a non-finite ``loss`` at all. With one rank no
    collective runs.
    """
    world_size = strategy.world_size
    device = strategy.root_device
    local = (_SKIP if loss is None else 0) + (_SIGNAL if signalled else 0)
    if loss is None or not check_loss:
        bits: torch.Tensor | int = local
    elif world_size == 1 or loss.device.type == "cpu":
        # Reading a CPU loss costs nothing to wait for, and one rank reads its answer
        # anyway: plain Python is far cheaper than a chain of tiny tensor ops.
        bits = local + (0 if _finite(loss) else _NONFINITE)
    else:
        # Stays on the loss's device: the one synchronisation is reading the result.
        finite = torch.isfinite(loss.detach()).all()
        bits = (~finite).to(device, torch.int32) * _NONFINITE + local
    if world_size == 1:
        flags = [int(bits)]
    else:
        slots = torch.zeros(world_size, dtype=torch.int32, device=device)
        slots[strategy.global_rank] = bits
        flags = strategy.collective.all_reduce(slots, "sum", out=slots).tolist()
    return StepDecision(
        skip=any(f & _SKIP for f in flags),
        nonfinite_ranks=tuple(r for r, f in enumerate(flags) if f & _NONFINITE),
        preempt_ranks=tuple(r for r, f in enumerate(flags) if f & _SIGNAL),
    )


def _finite(loss: torch.Tensor) -> bool:
    """Whether every element of ``loss`` is finite (a scalar is read as a Python number)."""
    if loss.numel() == 1 and not loss.is_complex():
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss.detach()).all())


def on_nonfinite(
    mode: str, ranks: tuple[int, ...], step: int, batch_idx: int, is_global_zero: bool
) -> None:
    """Act on a non-finite loss the ranks agreed on: raise, or warn (rank zero), by ``mode``.

    ``skip_step`` is the loop's to carry out; here it only warns on rank zero.

    Raises:
        NonFiniteValueError: ``mode="raise"`` (on every rank).
    """
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    what = f"The loss was NaN or infinite on {who} at step {step} (batch {batch_idx})"
    if mode == "raise":
        raise NonFiniteValueError(
            f"{what}. Every rank stops here. Lower the learning rate, clip gradients "
            "(gradient_clip_val=...), check the data of that batch, or pass "
            "Trainer(on_nonfinite='skip_step') to skip such steps.",
            ranks=ranks,
            step=step,
            metric="loss",
        )
    if is_global_zero:
        action = "skipped on every rank" if mode == "skip_step" else "trained on"
        warnings.warn(f"{what}; the step was {action}.", RuntimeWarning, stacklevel=3)
