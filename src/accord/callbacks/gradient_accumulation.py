"""`GradientAccumulationScheduler`: accumulate more (or fewer) batches from a given epoch on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["GradientAccumulationScheduler"]

# Engines that fix the accumulation when the run starts (in their engine or hooks).
_FIXED_ACCUMULATION = ("accord.engines.deepspeed", "accord.engines.horovod")


class GradientAccumulationScheduler(Callback):
    """Change ``accumulate_grad_batches`` at given epochs.

    ``GradientAccumulationScheduler({0: 1, 4: 2, 8: 4})`` steps after every batch in
    epochs 0-3, every 2 batches in epochs 4-7, and every 4 from epoch 8 on.

    Args:
        scheduling: ``{first epoch: batches per optimizer step}``; epochs before the
            smallest key use 1 (``scheduling`` then holds ``0: 1`` too, as in Lightning).

    Raises:
        ConfigurationError: an empty schedule, a negative epoch or a factor below 1; at fit
            start, a Trainer with its own ``accumulate_grad_batches``, a module with manual
            optimization, or a strategy that fixes the accumulation when it starts
            (DeepSpeed, Horovod).
    """

    def __init__(self, scheduling: Mapping[int, int]) -> None:
        if not scheduling:
            raise ConfigurationError(
                "GradientAccumulationScheduler needs a schedule, e.g. {0: 1, 4: 2}."
            )
        for epoch, factor in scheduling.items():
            if not isinstance(epoch, int) or epoch < 0:
                raise ConfigurationError(
                    f"GradientAccumulationScheduler: epoch {epoch!r} must be an int >= 0."
                )
            if not isinstance(factor, int) or factor < 1:
                raise ConfigurationError(
                    f"GradientAccumulationScheduler: factor {factor!r} at epoch {epoch} must "
                    "be an int >= 1."
                )
        self.scheduling = dict(sorted({0: 1, **scheduling}.items()))
        self.epochs = list(self.scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether any epoch accumulates more than one batch."""
        return any(factor > 1 for factor in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """Batches per optimizer step in ``epoch``."""
        current = 1
        for start, factor in self.scheduling.items():
            if epoch >= start:
                current = factor
        return current

    @override
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        if trainer.accumulate_grad_batches != 1 and trainer.accumulate_grad_batches != (
            self.get_accumulate_grad_batches(trainer.current_epoch)
        ):
            raise ConfigurationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and a "
                "GradientAccumulationScheduler both set the accumulation; keep one (leave "
                "the Trainer's at 1)."
            )
        if not module.automatic_optimization:
            raise ConfigurationError(
                "GradientAccumulationScheduler needs automatic optimization; "
                f"{type(module).__name__} optimizes manually (automatic_optimization=False), "
                "so accumulate in its training_step yourself, or drop the callback."
            )
        engine = [c.__module__ for c in type(trainer.strategy).__mro__]
        if any(name.startswith(_FIXED_ACCUMULATION) for name in engine):
            raise ConfigurationError(
                f"GradientAccumulationScheduler cannot change the accumulation of "
                f"{type(trainer.strategy).__name__}, which fixes it when the run starts. Use "
                "Trainer(accumulate_grad_batches=...) instead."
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"scheduling": dict(self.scheduling)}
