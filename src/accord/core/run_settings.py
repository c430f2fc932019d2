"""`RunSettings`: what the Trainer decided for a run that a strategy may need to know."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunSettings"]


@dataclass(frozen=True)
class RunSettings:
    """What the Trainer decided for a run that a strategy may need to know.

    The Trainer hands it over with `Strategy.configure_run` before it sets the module up,
    so a strategy never reads the Trainer itself.

    Attributes:
        accumulate_grad_batches: batches whose gradients add up to one optimizer step.
        gradient_clip_val: the value to clip gradients to, or None.
        gradient_clip_algorithm: ``"norm"`` (the total norm) or ``"value"`` (each element).
        manual_optimization: the module sets ``automatic_optimization = False``, so its
            ``training_step`` runs its own backward passes and optimizer steps.
        sync_batchnorm: BatchNorm layers compute their statistics over all ranks.
        on_rank_loss: ``"fail"`` or ``"continue"`` (``Trainer(on_rank_loss=...)``): in
            ``"continue"`` the collective has no watchdog (its store lives on rank 0, which
            may be lost); the heartbeats name the missing ranks instead.
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    manual_optimization: bool = False
    sync_batchnorm: bool = False
    on_rank_loss: str = "fail"
