"""`Callback`: code that runs at fixed points of a Trainer run, on every rank.

The hooks, their arguments and the order they run in are Lightning's: a callback's hook
runs before the module's hook of the same name, except ``on_train_epoch_end``, where the
callbacks that monitor a metric (`ModelCheckpoint`, `EarlyStopping`) run after the
module's so they see what it logged there. Only the hooks a callback's class overrides are
called: the others cost nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["Callback"]


class Callback:
    """Base class; override the hooks you need. Each is called on every rank."""

    @property
    def state_key(self) -> str:
        """The key this callback's state is stored under in a checkpoint."""
        return type(self).__qualname__

    # ------------------------------------------------------------------ a run
    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        """A run of ``stage`` (``"fit"``, ``"validate"``, ...) begins."""

    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None:
        """A run of ``stage`` ended."""

    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        """Fit begins, after the model was placed and wrapped."""

    def on_fit_end(self, trainer: Trainer, module: Module) -> None:
        """Fit ended."""

    def on_sanity_check_start(self, trainer: Trainer, module: Module) -> None:
        """The sanity check (``num_sanity_val_steps`` validation batches before training)
        begins."""

    def on_sanity_check_end(self, trainer: Trainer, module: Module) -> None:
        """The sanity check ended; its metrics were discarded."""

    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        """The run is failing with ``exception``."""

    # ------------------------------------------------------------------ training
    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        """Training begins: after `on_fit_start` and the sanity check, before the first
        epoch."""

    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        """Training ended (the last epoch, or a stop), before `on_fit_end`."""

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        """A training epoch begins."""

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        """A training epoch ended, after its validation if any; its epoch metrics are in
        ``trainer.callback_metrics``."""

    def on_train_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int
    ) -> None:
        """A training batch begins (``batch`` is already on the device)."""

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A training batch ended (its metrics are in ``trainer.callback_metrics``)."""

    def on_before_zero_grad(
        self, trainer: Trainer, module: Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """The gradients of ``optimizer`` are about to be cleared (at the start of each
        accumulation window, before its first backward)."""

    def on_before_backward(self, trainer: Trainer, module: Module, loss: torch.Tensor) -> None:
        """``loss`` is about to be backpropagated."""

    def on_after_backward(self, trainer: Trainer, module: Module) -> None:
        """Backward ran; gradients are in ``.grad``."""

    def on_before_optimizer_step(
        self, trainer: Trainer, module: Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """``optimizer`` is about to step: gradients are final and unscaled, not yet
        clipped."""

    # ---------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        """A validation pass begins (also the sanity check's)."""

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        """A validation pass ended; its epoch metrics are synced and available."""

    def on_validation_epoch_start(self, trainer: Trainer, module: Module) -> None:
        """A validation epoch begins."""

    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None:
        """A validation epoch ended; its metrics are in ``trainer.callback_metrics``."""

    def on_validation_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """A validation batch begins."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """A validation batch ended."""

    def on_test_start(self, trainer: Trainer, module: Module) -> None:
        """A test pass begins."""

    def on_test_end(self, trainer: Trainer, module: Module) -> None:
        """A test pass ended; its metrics are synced and available."""

    def on_test_epoch_start(self, trainer: Trainer, module: Module) -> None:
        """A test epoch begins."""

    def on_test_epoch_end(self, trainer: Trainer, module: Module) -> None:
        """A test epoch ended; its metrics are in ``trainer.callback_metrics``."""

    def on_test_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """A test batch begins."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """A test batch ended."""

    def on_predict_start(self, trainer: Trainer, module: Module) -> None:
        """A predict pass begins."""

    def on_predict_end(self, trainer: Trainer, module: Module) -> None:
        """A predict pass ended."""

    def on_predict_epoch_start(self, trainer: Trainer, module: Module) -> None:
        """A predict epoch begins."""

    def on_predict_epoch_end(self, trainer: Trainer, module: Module) -> None:
        """A predict epoch ended."""

    def on_predict_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """A predict batch begins."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """A predict batch ended."""

    # ---------------------------------------------------------------- checkpoints
    def on_save_checkpoint(
        self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint is about to be written; add to or change ``checkpoint``."""

    def on_load_checkpoint(
        self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint was loaded to resume or evaluate; read what `on_save_checkpoint`
        added."""

    def state_dict(self) -> dict[str, Any]:
        """State to store in checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
