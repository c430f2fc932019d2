"""The hooks of `accord.Module`, grouped as Lightning groups them.

`ModelHooks` are the points of a run (``on_fit_start``, ``on_train_batch_end``, ...),
`DataHooks` where the data comes from and how a batch reaches the device, and
`CheckpointHooks` what a checkpoint holds. Each hook has Lightning's name, arguments and
meaning; the Trainer calls a hook only where the module's class overrides it, so the ones
a module leaves alone cost nothing. The hooks whose default does something (putting the
module in eval mode, moving a batch) say so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from accord.core.buffers import move_to_device
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["CheckpointHooks", "DataHooks", "ModelHooks"]


def _model(hooks: ModelHooks) -> torch.nn.Module:
    """The module as the strategy wrapped it (Lightning's ``trainer.model``)."""
    model = hooks.trainer.model
    assert model is not None
    return model


class ModelHooks:
    """The points of a run a `Module` can act at."""

    @property
    def trainer(self) -> Trainer:
        """The Trainer running the module (`Module.trainer`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a run
    def on_fit_start(self) -> None:
        """Called when fit begins, after the model was placed and wrapped."""

    def on_fit_end(self) -> None:
        """Called when fit ends."""

    def configure_model(self) -> None:
        """Create modules here to have them created inside the strategy's context, after
        `setup` and before the model is wrapped (Lightning's hook for large models). It is
        called in every ``fit``/``validate``/``test``/``predict``: make it idempotent."""

    def configure_sharded_model(self) -> None:
        """Lightning's former name of `configure_model`; accord refuses a module that
        overrides it (rename the method to ``configure_model``)."""

    # ------------------------------------------------------------------ training
    def on_train_start(self) -> None:
        """Called before the first training epoch (after the sanity check)."""

    def on_train_end(self) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch (after its validation, if any); the
        epoch's training metrics are in ``self.trainer.callback_metrics``."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Called before each training batch. Return ``-1`` to skip the rest of the epoch."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before the gradients are cleared, at the start of each accumulation
        window (after its first ``training_step``, before its first backward)."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Called before ``loss`` is backpropagated."""

    def on_after_backward(self) -> None:
        """Called after backward, before the optimizer step."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before each optimizer step: gradients are final and unscaled, not yet
        clipped."""

    # ---------------------------------------------------------------- validation
    def on_validation_start(self) -> None:
        """Called when a validation pass begins (the sanity check's too)."""

    def on_validation_end(self) -> None:
        """Called when a validation pass ends."""

    def on_validation_epoch_start(self) -> None:
        """Called before a validation epoch."""

    def on_validation_epoch_end(self) -> None:
        """Called after a validation epoch; its metrics are in
        ``self.trainer.callback_metrics``."""

    def on_validation_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each validation batch."""

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called after each validation batch."""

    def on_validation_model_zero_grad(self) -> None:
        """Called when fit enters validation; by default clears the module's gradients
        (``zero_grad(set_to_none=True)``), as Lightning does, to free their memory."""
        module: Any = self
        module.zero_grad(set_to_none=True)

    def on_validation_model_eval(self) -> None:
        """Puts the module in eval mode for validation (the default)."""
        _model(self).eval()

    def on_validation_model_train(self) -> None:
        """Puts the module back in train mode after validation in fit (the default)."""
        _model(self).train()

    # ---------------------------------------------------------------------- test
    def on_test_start(self) -> None:
        """Called when a test pass begins."""

    def on_test_end(self) -> None:
        """Called when a test pass ends."""

    def on_test_epoch_start(self) -> None:
        """Called before a test epoch."""

    def on_test_epoch_end(self) -> None:
        """Called after a test epoch; its metrics are in ``self.trainer.callback_metrics``."""

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each test batch."""

    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called after each test batch."""

    def on_test_model_eval(self) -> None:
        """Puts the module in eval mode for testing (the default)."""
        _model(self).eval()

    def on_test_model_train(self) -> None:
        """Called after testing; by default restores the train mode the module had."""
        _model(self).train()

    # ------------------------------------------------------------------- predict
    def on_predict_start(self) -> None:
        """Called when a predict pass begins."""

    def on_predict_end(self) -> None:
        """Called when a predict pass ends."""

    def on_predict_epoch_start(self) -> None:
        """Called before a predict epoch."""

    def on_predict_epoch_end(self) -> None:
        """Called after a predict epoch."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each predict batch."""

    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called after each predict batch."""

    def on_predict_model_eval(self) -> None:
        """Puts the module in eval mode for prediction (the default)."""
        _model(self).eval()


class DataHooks:
    """Where a run's data comes from, and how each batch reaches the device.

    Attributes:
        prepare_data_per_node: True (the default): `prepare_data` runs on local rank zero
            of every node; False: on global rank zero only.
    """

    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Download or write data; called on local rank zero only (see
        ``prepare_data_per_node``), before `setup`, and every rank waits for it. Do not set
        state here: the other ranks never run it."""

    def setup(self, stage: str) -> None:
        """Called on every rank at the start of ``fit``/``validate``/``test``/``predict``."""

    def teardown(self, stage: str) -> None:
        """Called on every rank at the end of a run."""

    def train_dataloader(self) -> Any:
        """The training loader; called on every rank when ``fit`` got none."""
        raise ConfigurationError(
            f"{type(self).__name__} has no train_dataloader(); define it, or pass "
            "train_dataloaders= (or a datamodule) to fit()."
        )

    def val_dataloader(self) -> Any:
        """The validation loader; called on every rank when none was given."""
        raise ConfigurationError(
            f"{type(self).__name__} has no val_dataloader(); define it, or pass the loader "
            "to the Trainer method."
        )

    def test_dataloader(self) -> Any:
        """The test loader; called on every rank when ``test`` got none."""
        raise ConfigurationError(
            f"{type(self).__name__} has no test_dataloader(); define it, or pass "
            "dataloaders= to test()."
        )

    def predict_dataloader(self) -> Any:
        """The predict loader; called on every rank when ``predict`` got none."""
        raise ConfigurationError(
            f"{type(self).__name__} has no predict_dataloader(); define it, or pass "
            "dataloaders= to predict()."
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change ``batch`` before it moves to the device; return it."""
        return batch

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Move ``batch`` to ``device``; the default moves every tensor of a nested batch."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change ``batch`` after it reached the device; return it."""
        return batch


class CheckpointHooks:
    """What a checkpoint holds beyond the Trainer's own state."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to or change ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what `on_save_checkpoint` added, when a checkpoint is loaded."""
