"""`Callback`: code that runs at fixed points of a Trainer run, on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        """A run of ``stage`` (``"fit"``, ``"validate"``, ...) begins."""

    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None:
        """A run of ``stage`` ended."""

    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        """Fit begins."""

    def on_fit_end(self, trainer: Trainer, module: Module) -> None:
        """Fit ended."""

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        """Training begins: after `on_fit_start` and any restore, before the first epoch."""

    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        """Training ended (the last epoch, or a stop), before `on_fit_end`."""

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        """A training epoch begins."""

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A training batch ended (its metrics are in ``trainer.callback_metrics``)."""

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        """A training epoch ended, after its validation if any."""

    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        """A validation pass begins."""

    def on_validation_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A validation batch ended."""

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        """A validation pass ended; its epoch metrics are synced and available."""

    def on_test_start(self, trainer: Trainer, module: Module) -> None:
        """A test pass begins."""

    def on_predict_start(self, trainer: Trainer, module: Module) -> None:
        """A predict pass begins."""

    def on_test_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A test batch ended."""

    def on_predict_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A predict batch ended."""

    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        """The run is failing with ``exception``."""

    def state_dict(self) -> dict[str, Any]:
        """State to store in checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
