"""`Module`: an `nn.Module` with the training hooks, named as Lightning names them.

A ``LightningModule`` ports by changing its base class: ``training_step``,
``validation_step``, ``test_step``, ``predict_step``, ``configure_optimizers`` (in its usual
return forms), every hook (`accord.module_hooks`), the optimization hooks
(`accord.module_optimization`), ``self.log``, ``self.log_dict`` and ``self.all_gather``
keep their meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from typing_extensions import Self

from accord import hparams as _hp
from accord.errors import ConfigurationError
from accord.hparams import AttributeDict, HyperparametersMixin
from accord.module_hooks import CheckpointHooks, DataHooks, ModelHooks
from accord.module_optimization import OptimizationHooks, StrategyOptimizer

if TYPE_CHECKING:
    from accord.loggers.logger import Logger
    from accord.trainer.trainer import Trainer

__all__ = ["AttributeDict", "Module", "OptimizerConfig", "StrategyOptimizer"]

OptimizerConfig = Any
"""What ``configure_optimizers`` may return: an optimizer, a list of them, a
``(optimizers, schedulers)`` pair, or a dict ``{"optimizer": ..., "lr_scheduler": ...}``."""


class Module(
    ModelHooks, DataHooks, CheckpointHooks, OptimizationHooks, HyperparametersMixin, nn.Module
):
    """Base class for models trained by the `Trainer`.

    Attributes:
        CHECKPOINT_HYPER_PARAMS_KEY: where checkpoints keep the hyperparameters.
    """

    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner: Trainer | None = None
        self._automatic_optimization = True
        self._strict_loading: bool | None = None
        self._example_input_array: Any = None
        self._toggled: dict[nn.Parameter, bool] = {}

    @property
    def automatic_optimization(self) -> bool:
        """False: ``training_step`` does its own backward and optimizer steps (with
        `manual_backward`, `optimizers`, `lr_schedulers`), as in Lightning."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def strict_loading(self) -> bool:
        """Whether a checkpoint's weights must match the module's keys exactly when the
        Trainer or `load_from_checkpoint` loads them (default True)."""
        return True if self._strict_loading is None else self._strict_loading

    @strict_loading.setter
    def strict_loading(self, value: bool) -> None:
        self._strict_loading = bool(value)

    @property
    def example_input_array(self) -> Any:
        """An example input (``self(example_input_array)`` must run); loggers draw the
        graph with it (`Logger.log_graph`)."""
        return self._example_input_array

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self._example_input_array = example

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs: one, a list, or None. The Trainer adds them when a
        run starts, replacing a Trainer callback of the same type."""
        return []

    # ---------------------------------------------------------- hyperparameters
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location: str | torch.device | None = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        *,
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
            hparams_file: refused: accord keeps the hyperparameters in the checkpoint.
            strict: the checkpoint's keys must match the module's exactly (None: the
                module's `strict_loading`).
            weights_only: as in `torch.load`; False runs the pickled objects' code.
            overrides: ``__init__`` arguments to use instead of (or besides) the saved ones.

        Raises:
            CheckpointError: nothing readable at the path, or weights that do not fit.
            ConfigurationError: an ``hparams_file``.
        """
        if hparams_file is not None:
            raise ConfigurationError(
                f"load_from_checkpoint(hparams_file={str(hparams_file)!r}): accord keeps the "
                "hyperparameters in the checkpoint itself; pass any you want to change as "
                "keyword arguments instead."
            )
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

    @property
    def on_gpu(self) -> bool:
        """Whether the module's parameters are on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter (float32 without one)."""
        for param in self.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.float32

    @property
    def device_mesh(self) -> Any:
        """The device mesh of a model-parallel strategy; accord's strategies shard over
        their collective's process group instead, so this is always None."""
        return None

    @property
    def logger(self) -> Logger | None:
        """The Trainer's first logger (its ``experiment`` is the backend's own writer, a
        TensorBoard ``SummaryWriter`` for example), or None."""
        return self._owner.logger if self._owner is not None else None

    @property
    def loggers(self) -> list[Logger]:
        """The Trainer's loggers."""
        return self._owner.loggers if self._owner is not None else []

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
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a metric for the progress bar, the loggers and the callbacks.

        Args:
            name: the metric's key (``"val_loss"``).
            value: a number or a one-element tensor.
            prog_bar: show it in the progress bar.
            logger: send it to the loggers (default True).
            on_step: log the value of each step (default: True in ``training_step``).
            on_epoch: log the epoch aggregate (default: True outside ``training_step``);
                with both, the keys get ``_step`` and ``_epoch`` suffixes.
            reduce_fx: how steps combine into the epoch value and ranks into one value:
                ``"mean"`` (weighted by ``batch_size``), ``"sum"``, ``"max"`` or ``"min"``.
            enable_graph: refused when True: accord keeps logged values as numbers.
            sync_dist: reduce across ranks. All metrics of a step are synced together in
                one collective call.
            sync_dist_group: refused unless None: accord syncs over all ranks.
            add_dataloader_idx: accepted; accord runs one loader per stage, so no suffix
                is ever added.
            batch_size: the weight of this value in an epoch mean (default: the size of
                the batch's first tensor, as Lightning infers it).
            metric_attribute: refused unless None (accord logs numbers, not metric objects).
            rank_zero_only: the value is rank zero's alone: it is never synced.

        Raises:
            ConfigurationError: outside a run, under ``barebones=True``, or an option
                accord refuses.
        """
        owner = self._owner
        if owner is None:
            raise ConfigurationError(
                f"self.log({name!r}) was called outside a Trainer run; log from the step "
                "and epoch hooks."
            )
        if enable_graph or sync_dist_group is not None or metric_attribute is not None:
            raise ConfigurationError(
                f"self.log({name!r}, ...): enable_graph=True, sync_dist_group and "
                "metric_attribute are not supported; accord logs numbers and syncs them over "
                "all ranks (sync_dist=True)."
            )
        if getattr(owner, "barebones", False):
            raise ConfigurationError(
                f"self.log({name!r}) under Trainer(barebones=True): barebones mode turns "
                "logging off. Drop barebones=True to log."
            )
        owner.metric_store.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=True if logger is None else logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            sync_dist=sync_dist and not rank_zero_only,
            batch_size=batch_size,
        )

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data`` stacked along a new first dimension, in rank order.

        ``data`` is a tensor, a number, or a nested collection of them (each gathered);
        every rank's tensors must have the same shape. The gather runs on the strategy's
        collective, so it means the same on every strategy: the result has a leading
        dimension of ``world_size``, also on one device. With ``sync_grads`` the result
        carries gradients back to each rank's own input.

        Raises:
            ConfigurationError: a ``group`` (accord gathers over all ranks).
        """
        if group is not None:
            raise ConfigurationError(
                "self.all_gather(group=...) is not supported: accord gathers over all ranks "
                "through the strategy's collective."
            )
        strategy, device = self.trainer.strategy, self.device

        def gather(value: torch.Tensor | float) -> torch.Tensor:
            tensor = (
                value if isinstance(value, torch.Tensor) else torch.tensor(value, device=device)
            )
            return strategy.all_gather(tensor.unsqueeze(0), even=True, sync_grads=sync_grads)

        return apply_to_collection(data, (torch.Tensor, int, float), gather)

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

    # ----------------------------------------------------------------- export
    @torch.no_grad()
    def to_torchscript(
        self,
        file_path: str | Path | None = None,
        method: str = "script",
        example_inputs: Any = None,
    ) -> Any:
        """The module as TorchScript (``method="script"`` or ``"trace"`` with
        ``example_inputs``, default `example_input_array`); saved to ``file_path`` if given.

        Raises:
            ConfigurationError: another ``method``, or ``"trace"`` without an input.
        """
        mode = self.training
        if method == "script":
            scripted = torch.jit.script(self.eval())
        elif method == "trace":
            example = example_inputs if example_inputs is not None else self.example_input_array
            if example is None:
                raise ConfigurationError(
                    "to_torchscript(method='trace') needs example_inputs= or "
                    "self.example_input_array."
                )
            scripted = torch.jit.trace(self.eval(), example_inputs=example)  # type: ignore[no-untyped-call]
        else:
            raise ConfigurationError(f"to_torchscript(method={method!r}): use 'script' or 'trace'.")
        self.train(mode)
        if file_path is not None:
            torch.jit.save(scripted, str(file_path))
        return scripted

    def to_onnx(self, *args: Any, **kwargs: Any) -> None:
        """Refused: export with ``torch.onnx.export(model, example, path)`` (it needs the
        ``onnx`` package, which accord does not install).

        Raises:
            ConfigurationError: always.
        """
        raise ConfigurationError(
            "Module.to_onnx() is not part of accord: call torch.onnx.export(model, "
            "example_input, path) with the onnx package installed."
        )
