"""`ProgressBar`: a tqdm bar per epoch, on global rank zero only."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback

if TYPE_CHECKING:
    from tqdm import tqdm

    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Shows batches done, speed and the ``prog_bar=True`` metrics.

    Args:
        refresh_rate: update the bar every this many batches.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        self.refresh_rate = max(1, refresh_rate)
        self._bar: tqdm[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bar": None}

    def _open(self, trainer: Trainer, total: int | float | None, desc: str) -> None:
        from tqdm import tqdm

        self._close()
        if trainer.is_global_zero:
            self._bar = tqdm(
                total=total if total is not None and total < 2**62 else None,
                desc=desc,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
                unit="batch",
            )

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _advance(self, trainer: Trainer, batch_idx: int) -> None:
        if self._bar is None:
            return
        bar = self._bar
        last = bar.total == batch_idx + 1
        if (batch_idx + 1) % self.refresh_rate and not last:
            return
        # tqdm redraws at most every `mininterval` seconds; the metrics are formatted only
        # for an update that redraws, not on every batch.
        if last or time.time() - bar.last_print_t >= bar.mininterval:
            metrics = {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}
            if metrics:
                bar.set_postfix(metrics, refresh=False)
        bar.update(batch_idx + 1 - bar.n)

    @override
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._open(trainer, trainer.num_training_batches, f"Epoch {trainer.current_epoch}")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance(trainer, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._bar is not None:
            metrics = {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}
            self._bar.set_postfix(metrics)
        self._close()

    @override
    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        if trainer.stage != "fit":
            self._open(trainer, trainer.num_eval_batches, trainer.stage.capitalize())

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.stage != "fit":
            self._advance(trainer, batch_idx)

    @override
    def on_test_start(self, trainer: Trainer, module: Module) -> None:
        self._open(trainer, trainer.num_eval_batches, "Test")

    @override
    def on_predict_start(self, trainer: Trainer, module: Module) -> None:
        self._open(trainer, trainer.num_eval_batches, "Predict")

    @override
    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance(trainer, batch_idx)

    @override
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance(trainer, batch_idx)

    @override
    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None:
        self._close()

    @override
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        self._close()
