"""Progress bars: `ProgressBar`, the base class, and `TQDMProgressBar`, the tqdm bars."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from accord.callbacks.callback import Callback

if TYPE_CHECKING:
    from tqdm import tqdm

    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["ProgressBar", "TQDMProgressBar"]


class ProgressBar(Callback):
    """The base class of progress bars, as Lightning's: subclass it to draw your own.

    The Trainer treats any subclass as the run's progress bar (`Trainer.progress_bar_callback`;
    with one among the callbacks, ``enable_progress_bar`` adds no `TQDMProgressBar`).
    `setup` records the trainer and calls `disable` on every rank but global rank zero,
    so a subclass must implement `disable` and `enable`. The descriptions and batch
    totals are here for a subclass to use.
    """

    def __init__(self) -> None:
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer:
        """The Trainer of the run (set in `setup`)."""
        if self._trainer is None:
            raise TypeError(f"{type(self).__name__}.trainer is not set before the run's setup.")
        return self._trainer

    @property
    def sanity_check_description(self) -> str:
        """What the bar says during the sanity check."""
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        """What the bar says during training."""
        return "Training"

    @property
    def validation_description(self) -> str:
        """What the bar says during validation."""
        return "Validation"

    @property
    def test_description(self) -> str:
        """What the bar says during a test."""
        return "Testing"

    @property
    def predict_description(self) -> str:
        """What the bar says during predict."""
        return "Predicting"

    @property
    def total_train_batches(self) -> int | float:
        """Training batches this epoch (``inf`` for a loader without a length), capped by
        the optimizer steps left when only ``max_steps`` ends the fit."""
        trainer = self.trainer
        batches = trainer.num_training_batches
        if trainer.max_epochs in (None, -1) and trainer.max_steps > 0:
            return min(batches, trainer.max_steps - trainer.global_step)
        return batches

    @property
    def total_val_batches(self) -> int | float:
        """Batches of the current validation pass (the sanity check's during it)."""
        trainer = self.trainer
        batches = (
            trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        )
        return sum(batches)

    def disable(self) -> None:
        """Turn the bar off (called on every rank but global rank zero)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement disable() and enable(): the Trainer turns "
            "the bar off on every rank but global rank zero. For tqdm's bars use "
            "accord.callbacks.TQDMProgressBar."
        )

    def enable(self) -> None:
        """Turn the bar back on."""
        raise NotImplementedError(f"{type(self).__name__} must implement enable().")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print without breaking the bar (a plain `print` here)."""
        print(*args, **kwargs)

    @override
    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()

    def get_metrics(self, trainer: Trainer, module: Module) -> dict[str, int | str | float]:
        """What the bar shows after the counts: ``v_num`` (the loggers' version), ``ranks``
        (the ranks taking part of those started, once a rank was lost under
        ``on_rank_loss="continue"``), then the ``prog_bar=True`` metrics. Override to
        change it."""
        items: dict[str, int | str | float] = {}
        versions = list(dict.fromkeys(str(logger.version) for logger in trainer.loggers))
        if versions and versions != [""] and versions != ["None"]:
            version = "_".join(versions)
            # A long string version shows its last 4 characters.
            items["v_num"] = int(version) if version.isdigit() else version[-4:]
        started = trainer.num_nodes * trainer.num_devices
        if trainer.world_size != started:
            items["ranks"] = f"{trainer.world_size}/{started}"
        metrics = trainer.progress_bar_metrics
        if "v_num" in metrics and items:
            rank_zero_warn(
                "A metric logged with prog_bar=True is named 'v_num' and replaces the "
                "version the progress bar shows; rename it or override get_metrics().",
                category=UserWarning,
            )
        items.update(metrics)
        return items


def _total(value: int | float | None) -> int | None:
    """A total tqdm can show (None for an unknown or infinite one)."""
    if value is None or math.isinf(value) or math.isnan(value) or value >= 2**62:
        return None
    return int(value)


class TQDMProgressBar(ProgressBar):
    """tqdm's bars on global rank zero, as Lightning's default progress bar.

    One bar for training (its total is the epoch's batches; it shows ``v_num`` and the
    ``prog_bar=True`` metrics), one under it while validation runs, and one for the
    sanity check, a test and predict, each made by an ``init_<stage>_tqdm`` method a
    subclass may override, as in Lightning. The bars write to standard error.

    Args:
        refresh_rate: redraw every this many batches; 0 turns the bars off. A larger
            ``TQDM_MINITERS`` environment variable wins, as in Lightning.
        process_position: draw the bars this many pairs of lines lower (for several
            progress bars at once).
        leave: keep each epoch's finished training bar on the screen (one bar per epoch);
            False (default) reuses one training bar across the epochs.
    """

    def __init__(
        self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False
    ) -> None:
        super().__init__()
        if "TQDM_MINITERS" in os.environ:
            refresh_rate = max(int(os.environ["TQDM_MINITERS"]), refresh_rate)
        self._refresh_rate = refresh_rate
        self._process_position = process_position
        self._leave = leave
        self._enabled = True
        self._train_bar: tqdm[Any] | None = None
        self._eval_bar: tqdm[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_train_bar": None, "_eval_bar": None}

    @property
    def refresh_rate(self) -> int:
        """Redraw every this many batches (0: the bars are off)."""
        return self._refresh_rate

    @property
    def process_position(self) -> int:
        """The bars' offset, in pairs of lines."""
        return self._process_position

    @property
    def is_enabled(self) -> bool:
        """Whether the bars are drawn."""
        return self._enabled and self._refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        """Whether the bars are off."""
        return not self.is_enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _bar(self, desc: str, total: int | float | None, offset: int, leave: bool) -> tqdm[Any]:
        from tqdm import tqdm

        return tqdm(
            total=_total(total),
            desc=desc,
            position=2 * self._process_position + offset,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=sys.stderr,
            unit="batch",
        )

    def init_sanity_tqdm(self) -> tqdm[Any]:
        """The sanity check's bar; override to change it (as in Lightning)."""
        return self._bar(self.sanity_check_description, None, 0, leave=False)

    def init_train_tqdm(self) -> tqdm[Any]:
        """The training bar; override to change it."""
        return self._bar(self.train_description, None, 0, leave=True)

    def init_validation_tqdm(self) -> tqdm[Any]:
        """The validation bar (under the training bar during fit); override to change it."""
        in_fit = self.trainer.stage == "fit"
        return self._bar(self.validation_description, None, int(in_fit), leave=not in_fit)

    def init_test_tqdm(self) -> tqdm[Any]:
        """The test bar; override to change it."""
        return self._bar(self.test_description, None, 0, leave=True)

    def init_predict_tqdm(self) -> tqdm[Any]:
        """The predict bar; override to change it."""
        return self._bar(self.predict_description, None, 0, leave=True)

    def _open_eval(self, make: Callable[[], tqdm[Any]], total: int | float) -> None:
        self._close_eval()
        bar = make()
        bar.reset(total=_total(total))
        self._eval_bar = bar

    def _close_train(self) -> None:
        if self._train_bar is not None:
            self._train_bar.close()
            self._train_bar = None

    def _close_eval(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def _advance(self, bar: tqdm[Any] | None, trainer: Trainer, module: Module, n: int) -> None:
        if bar is None or bar.disable:
            return
        last = bar.total == n
        if n % self._refresh_rate and not last:
            return
        # tqdm redraws at most every `mininterval` seconds; the metrics are gathered only
        # for an update that redraws, not on every batch.
        is_train = self._train_bar is not None and bar is self._train_bar
        if is_train and (last or time.time() - bar.last_print_t >= bar.mininterval):
            self._show_metrics(bar, trainer, module, refresh=False)
        bar.update(n - bar.n)

    def _show_metrics(
        self, bar: tqdm[Any], trainer: Trainer, module: Module, refresh: bool = True
    ) -> None:
        shown = {
            k: f"{v:.4g}" if isinstance(v, float) else v
            for k, v in self.get_metrics(trainer, module).items()
        }
        if shown:
            bar.set_postfix(shown, refresh=refresh)

    # ----------------------------------------------------------------- training
    @override
    def on_sanity_check_end(self, trainer: Trainer, module: Module) -> None:
        self._close_eval()

    @override
    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        if not self._leave:
            self._close_train()
            self._train_bar = self.init_train_tqdm()

    @override
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self._leave or self._train_bar is None:
            self._close_train()
            self._train_bar = self.init_train_tqdm()
        bar = self._train_bar
        bar.reset(total=_total(self.total_train_batches))
        bar.set_description(f"Epoch {trainer.current_epoch}")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance(self._train_bar, trainer, module, batch_idx + 1)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._train_bar is not None and not self._train_bar.disable:
            self._show_metrics(self._train_bar, trainer, module)
        if self._leave:
            self._close_train()

    @override
    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        self._close_train()

    # --------------------------------------------------------------- evaluation
    @override
    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        make = self.init_sanity_tqdm if trainer.sanity_checking else self.init_validation_tqdm
        self._open_eval(make, self.total_val_batches)

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
        self._advance(self._eval_bar, trainer, module, batch_idx + 1)

    @override
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        self._close_eval()
        bar = self._train_bar
        in_fit = trainer.stage == "fit" and not trainer.sanity_checking
        if bar is not None and in_fit and not bar.disable:
            self._show_metrics(bar, trainer, module)

    @override
    def on_test_start(self, trainer: Trainer, module: Module) -> None:
        self._open_eval(self.init_test_tqdm, sum(trainer.num_test_batches))

    @override
    def on_test_end(self, trainer: Trainer, module: Module) -> None:
        self._close_eval()

    @override
    def on_predict_start(self, trainer: Trainer, module: Module) -> None:
        self._open_eval(self.init_predict_tqdm, sum(trainer.num_predict_batches))

    # Validation, test and predict share the evaluation bar: a batch of any of them
    # advances it the same way, and a test or predict pass ends by closing it.
    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end
    on_predict_end = on_test_end

    @override
    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None:
        self._close_eval()
        self._close_train()

    @override
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        self._close_eval()
        self._close_train()
