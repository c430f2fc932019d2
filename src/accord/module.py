"""`Module`: an `nn.Module` with the training hooks, named as Lightning names them.

A ``LightningModule`` ports by changing its base class: ``training_step``,
``validation_step``, ``test_step``, ``predict_step``, ``configure_optimizers`` (in its usual
return forms), the ``on_*`` hooks, ``self.log`` and ``self.log_dict`` keep their meaning.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import Self

from accord import hparams as _hp
from accord import manual_optimization as _manual
from accord.errors import ConfigurationError
from accord.hparams import AttributeDict
from accord.manual_optimization import ManualOptimizer

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["AttributeDict", "ManualOptimizer", "Module", "OptimizerConfig"]

OptimizerConfig = Any
"""What ``configure_optimizers`` may return: an optimizer, a list of them, a
``(optimizers, schedulers)`` pair, or a dict ``{"optimizer": ..., "lr_scheduler": ...}``."""


class Module(nn.Module):
    """Base class for models trained by the `Trainer`."""

    def __init__(self) -> None:
        super().__init__()
        self._owner: Trainer | None = None
        self._hparams = AttributeDict()
        self._automatic_optimization = True
        self._toggled: dict[nn.Parameter, bool] = {}

    # ------------------------------------------------------ manual optimization
    @property
    def automatic_optimization(self) -> bool:
        """False: ``training_step`` does its own backward and optimizer steps (with
        `manual_backward`, `optimizers`, `lr_schedulers`), as in Lightning."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def wrapped_module(self) -> nn.Module:
        """The module as the strategy wrapped it for the current run.

        Raises:
            ConfigurationError: outside a run.
        """
        return _manual.wrapped_module_of(self)

    def optimizers(self) -> ManualOptimizer | list[ManualOptimizer]:
        """The fit's optimizers (one, or a list), wrapped for manual optimization."""
        return _manual.optimizers_of(self)

    def lr_schedulers(self) -> Any:
        """The fit's LR schedulers: one, a list, or None. Step them yourself under
        manual optimization."""
        return _manual.schedulers_of(self)

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` through the strategy (its precision's scaling included),
        with the ``on_before_backward`` and ``on_after_backward`` hooks."""
        self.on_before_backward(loss)
        self.trainer.strategy.backward(loss, self.wrapped_module)
        self.on_after_backward()

    def clip_gradients(
        self, optimizer: ManualOptimizer | torch.optim.Optimizer, gradient_clip_val: float
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters to total norm
        ``gradient_clip_val``, before its step (the other optimizers' are left alone)."""
        _manual.clip_gradients_of(self, optimizer, gradient_clip_val)

    def toggle_optimizer(self, optimizer: ManualOptimizer | torch.optim.Optimizer) -> None:
        """Let only ``optimizer``'s parameters require gradients (the other optimizers'
        are frozen) until `untoggle_optimizer`; for alternating updates such as a GAN's."""
        _manual.freeze_others(self, optimizer)

    def untoggle_optimizer(self, optimizer: ManualOptimizer | torch.optim.Optimizer) -> None:
        """Undo `toggle_optimizer`: every parameter requires gradients as before."""
        _manual.restore_requires_grad(self)

    # ---------------------------------------------------------- hyperparameters
    @property
    def hparams(self) -> AttributeDict:
        """The hyperparameters `save_hyperparameters` recorded (empty until it is called)."""
        return self._hparams

    def save_hyperparameters(self, *args: Any, ignore: str | Sequence[str] | None = None) -> None:
        """Record the ``__init__`` arguments as ``self.hparams``, as Lightning does.

        Call it in ``__init__``. Without ``args`` every argument of the ``__init__`` that
        calls it is recorded; with names (``save_hyperparameters("lr", "width")``) only
        those; with one dict, that dict. The Trainer stores them in every checkpoint (under
        ``"hyper_parameters"``) and gives them to its loggers at the start of ``fit``;
        `load_from_checkpoint` passes them back to ``__init__``. Only plain values (numbers,
        strings, lists, dicts, tensors) go into checkpoints, which load with
        ``weights_only=True``; others (a class, a module) stay out, with a warning, and are
        passed again to `load_from_checkpoint`.

        Args:
            args: argument names to record, or one dict to record as it is.
            ignore: argument names to leave out (a module or a dataset passed in, say).

        Raises:
            ConfigurationError: a name that is not an argument of the calling ``__init__``,
                or a call from outside a function.
        """
        _hp.record_hparams(self, _hp.hparams_to_record(self, inspect.currentframe(), args, ignore))

    def hparams_for_checkpoint(self) -> dict[str, Any]:
        """The hyperparameters a checkpoint stores: those that load with
        ``weights_only=True`` (plain values), so reading the checkpoint runs no code."""
        return {k: v for k, v in self._hparams.items() if _hp.loads_safely(v)}

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        *,
        map_location: str | torch.device | None = None,
        strict: bool = True,
        weights_only: bool = True,
        **overrides: Any,
    ) -> Self:
        """Build the module from a checkpoint's hyperparameters and load its weights.

        ``cls(**hyperparameters, **overrides)`` is built with what `save_hyperparameters`
        recorded (``overrides`` replace or add arguments), then the checkpoint's weights
        are loaded into it. The file (or a directory FSDP or DeepSpeed wrote) is read as
        every accord checkpoint is: with ``weights_only=True`` unless you pass False for a
        checkpoint you trust.

        Args:
            checkpoint_path: a checkpoint file or directory the Trainer wrote.
            map_location: the device to put the weights on (default: where ``cls`` builds
                them, the CPU).
            strict: the checkpoint's keys must match the module's exactly.
            weights_only: as in `torch.load`; False runs the pickled objects' code.
            overrides: ``__init__`` arguments to use instead of (or besides) the saved ones.

        Raises:
            CheckpointError: nothing readable at the path, or weights that do not fit.
        """
        return _hp.load_module(cls, checkpoint_path, map_location, strict, weights_only, overrides)

    # ------------------------------------------------------------------ context
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module.

        Raises:
            ConfigurationError: the module is not attached to a Trainer.
        """
        if self._owner is None:
            raise ConfigurationError(
                f"{type(self).__name__} is not attached to a Trainer; call trainer.fit(model) "
                "(or validate/test/predict) first."
            )
        return self._owner

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        self._owner = trainer

    @property
    def device(self) -> torch.device:
        """The device of the first parameter (CPU for a module without parameters)."""
        for param in self.parameters():
            return param.device
        return torch.device("cpu")

    @property
    def current_epoch(self) -> int:
        """The epoch the Trainer is in (0-based)."""
        return self._owner.current_epoch if self._owner is not None else 0

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self._owner.global_step if self._owner is not None else 0

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return self._owner.global_rank if self._owner is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._owner.local_rank if self._owner is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer is not part of the model: a pickled module (ddp_spawn) travels alone.
        state = dict(self.__dict__)
        state["_owner"] = None
        return state

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: torch.Tensor | float,
        *,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record a metric for the progress bar, the loggers and the callbacks.

        Args:
            name: the metric's key (``"val_loss"``).
            value: a number or a one-element tensor.
            prog_bar: show it in the progress bar.
            logger: send it to the loggers.
            on_step: log the value of each step (default: True in ``training_step``).
            on_epoch: log the epoch aggregate (default: True outside ``training_step``);
                with both, the keys get ``_step`` and ``_epoch`` suffixes.
            reduce_fx: how steps combine into the epoch value and ranks into one value:
                ``"mean"`` (weighted by ``batch_size``), ``"sum"``, ``"max"`` or ``"min"``.
            sync_dist: reduce across ranks. All metrics of a step are synced together in
                one collective call.
            batch_size: the weight of this value in an epoch mean (default: 1).
        """
        if self._owner is None:
            raise ConfigurationError(
                f"self.log({name!r}) was called outside a Trainer run; log from the step "
                "and epoch hooks."
            )
        self._owner.metric_store.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            sync_dist=sync_dist,
            batch_size=batch_size,
        )

    def log_dict(self, metrics: Mapping[str, torch.Tensor | float], **kwargs: Any) -> None:
        """`log` every item of ``metrics`` with the same options."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    # -------------------------------------------------------------- the steps
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute the loss of one batch: a tensor, or a dict with a ``"loss"`` key."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement training_step(batch, batch_idx) to be fit."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one validation batch (log metrics with ``self.log``)."""

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one test batch (log metrics with ``self.log``)."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the prediction for one batch; by default ``self(batch)``."""
        return self(batch)

    def configure_optimizers(self) -> OptimizerConfig:
        """Return the optimizer(s), and optionally learning-rate schedulers."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement configure_optimizers() to be fit."
        )

    # ------------------------------------------------------------------ hooks
    def setup(self, stage: str) -> None:
        """Called on every rank at the start of ``fit``/``validate``/``test``/``predict``."""

    def teardown(self, stage: str) -> None:
        """Called on every rank at the end of a run."""

    def on_fit_start(self) -> None:
        """Called when fit begins, after the model was placed and wrapped."""

    def on_fit_end(self) -> None:
        """Called when fit ends."""

    def on_train_start(self) -> None:
        """Called before the first training epoch."""

    def on_train_end(self) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch (after its validation, if any)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called before each training batch."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch."""

    def on_validation_epoch_start(self) -> None:
        """Called before a validation pass."""

    def on_validation_epoch_end(self) -> None:
        """Called after a validation pass."""

    def on_test_epoch_start(self) -> None:
        """Called before a test pass."""

    def on_test_epoch_end(self) -> None:
        """Called after a test pass."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Called before ``loss`` is backpropagated."""

    def on_after_backward(self) -> None:
        """Called after backward, before the optimizer step."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before each optimizer step (gradients are final and unscaled)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to or change ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what `on_save_checkpoint` added, when resuming."""
