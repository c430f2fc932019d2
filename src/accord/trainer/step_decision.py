"""The decision every rank takes together once per training batch, in one collective.

Three questions share one ``all_reduce(sum)`` of a few integers with a 3-bit field per
rank: did a rank skip the batch (``training_step`` returned None), was a rank's loss NaN
or infinite, and did a rank receive a preemption signal. Each rank writes its answers into
its own field, so the sum tells every rank which ranks said what, and a plain step makes
the same single round trip it made for the skip decision alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.core.strategy import Strategy
from accord.errors import ConfigurationError, NonFiniteValueError

__all__ = [
    "NONFINITE_MODES",
    "PLAIN_DECISION",
    "finite",
    "StepDecision",
    "check_nonfinite_mode",
    "decide_step",
    "on_nonfinite",
    "carried_decision",
    "local_bits",
]

NONFINITE_MODES = ("raise", "skip_step", "warn")
"""What ``Trainer(on_nonfinite=...)`` accepts."""

_SKIP, _NONFINITE, _SIGNAL = 1, 2, 4
_FIELD_BITS, _FIELD_MASK, _RANKS_PER_WORD = 3, 0b111, 10


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
    bits = local_bits(strategy, loss, check_loss, signalled)
    world_size = strategy.world_size
    if world_size == 1:
        return PLAIN_DECISION if bits == 0 else _from_flags([int(bits)])
    slots = _slots(strategy, bits)
    words = strategy.collective.all_reduce(slots, "sum", out=slots).tolist()
    return _decision(words, world_size)


def carried_decision(flags: list[int]) -> StepDecision:
    """The decision from every rank's bits as the gradient synchronisation carried them
    (`Strategy.carries_step_decision`): ``flags[r]`` holds rank ``r``'s answers."""
    return PLAIN_DECISION if not any(flags) else _from_flags(flags)


def local_bits(
    strategy: Strategy, loss: torch.Tensor | None, check_loss: bool, signalled: bool
) -> torch.Tensor | int:
    """This rank's answers for `decide_step` as bits: a Python int, or a tensor on the
    loss's device (which the caller reads after the collective)."""
    local = (_SKIP if loss is None else 0) + (_SIGNAL if signalled else 0)
    if loss is None or not check_loss:
        return local
    if loss.device.type == "cpu" or strategy.world_size == 1:
        # Reading a CPU loss costs nothing to wait for, and one rank reads its answer
        # anyway: plain Python is far cheaper than a chain of tiny tensor ops.
        return local + (0 if finite(loss) else _NONFINITE)
    # Stays on the loss's device: the one synchronisation is reading the result.
    all_finite = torch.isfinite(loss.detach()).all()
    return (~all_finite).to(strategy.root_device, torch.int32) * _NONFINITE + local


def _slots(strategy: Strategy, bits: torch.Tensor | int) -> torch.Tensor:
    """The words every rank sums: a 3-bit field per rank, this rank's holding ``bits``.

    Ten ranks share an int32 word (the fields never overlap, so the sum is exact); a small
    tensor travels in one round trip where gloo splits a longer one into several.
    """
    world_size, rank = strategy.world_size, strategy.global_rank
    words = -(-world_size // _RANKS_PER_WORD)
    slots = torch.zeros(words, dtype=torch.int32, device=strategy.root_device)
    slots[rank // _RANKS_PER_WORD] = bits * (1 << (_FIELD_BITS * (rank % _RANKS_PER_WORD)))
    return slots


def _decision(words: list[int], world_size: int) -> StepDecision:
    return _from_flags(
        [
            (words[r // _RANKS_PER_WORD] >> (_FIELD_BITS * (r % _RANKS_PER_WORD))) & _FIELD_MASK
            for r in range(world_size)
        ]
    )


PLAIN_DECISION = StepDecision(skip=False, nonfinite_ranks=(), preempt_ranks=())
"""The decision of a batch on which no rank said anything (nearly every batch)."""


def _from_flags(flags: list[int]) -> StepDecision:
    return StepDecision(
        skip=any(f & _SKIP for f in flags),
        nonfinite_ranks=tuple(r for r, f in enumerate(flags) if f & _NONFINITE),
        preempt_ranks=tuple(r for r, f in enumerate(flags) if f & _SIGNAL),
    )


def finite(loss: torch.Tensor) -> bool:
    """Whether every element of ``loss`` is finite (a scalar is read as a Python number)."""
    if loss.numel() == 1 and not loss.is_complex():
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss.detach()).all())


def on_nonfinite(mode: str, ranks: tuple[int, ...], step: int, batch_idx: int) -> None:
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
    action = "skipped on every rank" if mode == "skip_step" else "trained on"
    rank_zero_warn(f"{what}; the step was {action}.", category=RuntimeWarning, stacklevel=4)
