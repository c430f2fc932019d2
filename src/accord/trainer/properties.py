"""`TrainerProperties`: what a `Trainer` tells about itself and the run in progress.

Lightning's names and meanings: identity (ranks, devices), the module and its wrapper, the
callbacks and loggers, the stage flags (``training``, ``sanity_checking``, ...), the batch
counts, the loaders and the logged metrics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accord.accelerators.accelerator import Accelerator
from accord.callbacks.early_stopping import EarlyStopping
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.progress import ProgressBar
from accord.errors import ConfigurationError
from accord.loggers.logger import Logger
from accord.module import Module
from accord.precision import Precision
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import SchedulerConfig

if TYPE_CHECKING:
    from accord.callbacks.callback import Callback
    from accord.core.strategy import Strategy
    from accord.trainer.state import RunState

__all__ = ["TrainerProperties"]


class TrainerProperties:
    """The read-only views of a `Trainer` (its base class)."""

    strategy: Strategy
    callbacks: list[Callback]
    loggers: list[Logger]
    default_root_dir: Path
    accumulate_grad_batches: int
    max_epochs: int | None
    max_steps: int
    num_training_batches: int | float
    stage: str
    _state: RunState

    # ------------------------------------------------------------------ identity
    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This process's node."""
        return self.strategy.node_rank

    @property
    def world_size(self) -> int:
        """Processes taking part."""
        return self.strategy.world_size

    @property
    def num_nodes(self) -> int:
        """Machines taking part."""
        return getattr(self.strategy, "num_nodes", 1)

    @property
    def device_ids(self) -> list[int]:
        """The device indices this node's processes use."""
        ids = getattr(self.strategy, "parallel_devices", None)
        if ids:
            return [d.index if d.index is not None else i for i, d in enumerate(ids)]
        index = self.strategy.root_device.index
        return [index if index is not None else 0]

    @property
    def num_devices(self) -> int:
        """Devices (processes) per node."""
        return len(self.device_ids)

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank zero."""
        return self.strategy.is_global_zero

    @property
    def accelerator(self) -> Accelerator | None:
        """The strategy's accelerator."""
        return self.strategy.accelerator

    @property
    def precision(self) -> str:
        """The precision mode, e.g. ``"32-true"``."""
        return str(self.strategy.precision.mode.value)

    @property
    def precision_plugin(self) -> Precision:
        """The strategy's `Precision` (Lightning's precision plugin)."""
        return self.strategy.precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler of ``16-mixed``, else None."""
        return self.strategy.precision.scaler

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas``/``rank`` of the strategy's `DistributedSampler`, or None."""
        return self.strategy.distributed_sampler_kwargs

    # ------------------------------------------------------------------ the model
    @property
    def lightning_module(self) -> Module | None:
        """The user's module of the current (or last) run."""
        return self._state.module

    @property
    def model(self) -> torch.nn.Module | None:
        """The module as the strategy wrapped it during a run (DDP, ...), else the module."""
        return self._state.wrapped if self._state.wrapped is not None else self._state.module

    @property
    def model_wrapper(self) -> torch.nn.Module | None:
        """The module as the strategy wrapped it, during a run (None outside one)."""
        return self._state.wrapped

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the current fit."""
        return self._state.optimizers

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """The LR schedulers of the current fit, with when each steps."""
        return self._state.schedulers

    # ------------------------------------------------------------ callbacks, logs
    @property
    def logger(self) -> Logger | None:
        """The first logger, or None."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> Path:
        """The first logger's run directory (``<root>/logs/version_N``), or
        ``default_root_dir`` without a logger."""
        logger = self.logger
        return logger.log_dir if logger is not None else self.default_root_dir

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint`, or None."""
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """Every `ModelCheckpoint`."""
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        """The first `EarlyStopping`, or None."""
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        """Every `EarlyStopping`."""
        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        """The `ProgressBar`, or None."""
        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    @property
    def metric_store(self) -> MetricStore:
        """Where the running module's ``self.log`` records its values."""
        return self._state.metrics

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric."""
        return self._state.metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The latest value of every ``prog_bar=True`` metric."""
        return self._state.metrics.progress_bar_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The latest value of every metric sent to the loggers (``logger=True``).

        Names are as the loggers see them: a metric logged with ``on_step=True,
        on_epoch=True`` appears as ``<name>_step`` and ``<name>_epoch``. Step values are
        included every ``log_every_n_steps`` steps, as the loggers get them; the dict is
        kept even when the Trainer has no logger.
        """
        return self._state.metrics.logged_metrics

    # --------------------------------------------------------------- the run state
    @property
    def training(self) -> bool:
        """Whether training batches are running (not validation inside fit)."""
        return self._state.running == "train"

    @property
    def validating(self) -> bool:
        """Whether a validation pass is running (the sanity check's included)."""
        return self._state.running in ("validate", "sanity_check")

    @property
    def testing(self) -> bool:
        """Whether a test pass is running."""
        return self._state.running == "test"

    @property
    def predicting(self) -> bool:
        """Whether a predict pass is running."""
        return self._state.running == "predict"

    @property
    def evaluating(self) -> bool:
        """Whether a validation or test pass is running."""
        return self.validating or self.testing

    @property
    def sanity_checking(self) -> bool:
        """Whether the sanity check (validation before training) is running."""
        return self._state.running == "sanity_check"

    @property
    def interrupted(self) -> bool:
        """Whether the last run ended with an exception (a KeyboardInterrupt included)."""
        return self._state.interrupted

    @property
    def received_sigterm(self) -> bool:
        """Whether this rank received SIGTERM during the current (or last) fit."""
        return self._state.received_sigterm

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the current (or last) run restored, or None."""
        return self._state.ckpt_path

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch running is the epoch's last."""
        return self._state.is_last_batch

    @property
    def enable_validation(self) -> bool:
        """Whether this fit validates (a validation loader, a ``validation_step`` and a
        non-zero ``limit_val_batches``)."""
        return bool(getattr(self, "has_validation", False))

    # -------------------------------------------------------------------- loaders
    @property
    def train_dataloader(self) -> Any:
        """The training loader of the current (or last) fit, as each rank uses it."""
        return self._state.train_loader

    @property
    def val_dataloaders(self) -> Any:
        """The validation loader of the current (or last) run."""
        return self._state.val_loader

    @property
    def test_dataloaders(self) -> Any:
        """The test loader of the current (or last) run."""
        return self._state.eval_loaders.get("test")

    @property
    def predict_dataloaders(self) -> Any:
        """The predict loader of the current (or last) run."""
        return self._state.eval_loaders.get("predict")

    @property
    def num_val_batches(self) -> list[int]:
        """Validation batches per pass, per loader."""
        return list(self._state.eval_batches.get("validate", []))

    @property
    def num_sanity_val_batches(self) -> list[int]:
        """Validation batches the sanity check runs, per loader."""
        return list(self._state.eval_batches.get("sanity_check", []))

    @property
    def num_test_batches(self) -> list[int]:
        """Test batches, per loader."""
        return list(self._state.eval_batches.get("test", []))

    @property
    def num_predict_batches(self) -> list[int]:
        """Predict batches, per loader."""
        return list(self._state.eval_batches.get("predict", []))

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps this fit will take: epochs x ceil(batches / accumulation),
        capped by ``max_steps`` (``math.inf`` for an endless fit).

        Usable from ``configure_optimizers`` (a OneCycleLR's ``total_steps``): the training
        loader is prepared first if it is not yet, with this rank's share of the data.

        Raises:
            ConfigurationError: outside a fit.
        """
        if self.max_epochs == -1:
            return math.inf if self.max_steps == -1 else self.max_steps
        loader = self._state.train_loader
        if loader is None:
            prepare = self._state.prepare_train
            if prepare is None:
                raise ConfigurationError(
                    "trainer.estimated_stepping_batches is known during fit() (from "
                    "configure_optimizers on): it needs the training loader."
                )
            prepare()
        total = self.num_training_batches
        if total == math.inf or total >= 2**62:
            return self.max_steps if self.max_steps != -1 else math.inf
        assert self.max_epochs is not None
        steps = math.ceil(total / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create the module's tensors on the strategy's device (and in the true precision's
        dtype) inside this context, as Lightning's ``Trainer.init_module``.

        ``empty_init`` is accepted for Lightning's signature; accord always initialises.
        """
        precision = self.strategy.precision
        dtype = precision.param_dtype
        previous = torch.get_default_dtype()
        with torch.device(self.strategy.root_device):
            if dtype is not None:
                torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self.is_global_zero:
            print(*args, **kwargs)
