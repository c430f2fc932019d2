"""`Trainer`: runs fit / validate / test / predict loops on any `Strategy`.

The Trainer never communicates itself: every cross-rank question goes to
``self.strategy`` (which asks its collective). Its parts live beside it: the loops
(`run`, `loops`, `fit_loop`), the data (`data`), checkpoints (`checkpointing`) and
the optimizers (`optimizers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.callbacks.callback import Callback
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.core.strategy import Strategy
from accord.datamodule import DataModule, check_datamodule
from accord.errors import ConfigurationError
from accord.loggers.logger import Logger
from accord.module import Module
from accord.trainer.arguments import build_callbacks, build_loggers, check_limit, check_positive
from accord.trainer.checkpointing import checkpoint_state
from accord.trainer.connector import connect
from accord.trainer.data import module_loader, overrides
from accord.trainer.fit_loop import check_manual
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import SchedulerConfig
from accord.trainer.preemption import DEFAULT_PREEMPTION_SIGNALS, SignalLike, parse_signals
from accord.trainer.recovery import restart_checkpoint
from accord.trainer.run import run_stage
from accord.trainer.state import RankZeroResults, RunState
from accord.trainer.step_decision import check_nonfinite_mode

__all__ = ["Trainer"]


class Trainer:
    """Trains and evaluates a `Module` with a strategy.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"``, ``"auto"`` or an `Accelerator`.
        strategy: a registered name (``"ddp"``, ``"ddp_spawn"``, ``"dp"``, ...; see
            `StrategyRegistry`), a `Strategy` instance, or ``"auto"``.
        devices: devices (processes, on CPU) per node: a count, ``"auto"``, ``-1`` or indices.
        num_nodes: machines taking part.
        precision: ``"32-true"`` (the default, unless a `Strategy` instance brings its own
            `Precision`), ``"bf16-mixed"``, ``"16-mixed"`` (CUDA), ``"bf16-true"`` or
            ``"16-true"``.
        max_epochs: stop after this many epochs (default 1000 when ``max_steps`` is unset).
        max_steps: stop after this many optimizer steps (``-1``: no limit).
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches:
            batches per epoch: an int count, a float fraction, or None for all.
        val_check_interval: validate every this many training batches (int) or fraction of
            an epoch (float); default once per epoch.
        check_val_every_n_epoch: validate every this many epochs.
        accumulate_grad_batches: batches whose gradients add up to one optimizer step.
        gradient_clip_val: clip the gradients' total norm to this value.
        deterministic: use deterministic algorithms only.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        callbacks: extra `Callback` objects.
        logger: a `Logger`, a list of them, True (a `CSVLogger`) or False.
        enable_progress_bar: show a progress bar on global rank zero.
        enable_checkpointing: add a default `ModelCheckpoint` unless one is given.
        log_every_n_steps: how often step metrics go to the loggers.
        profiler: ``"collectives"`` counts the calls and time of every collective op on
            each rank and prints a table per rank at the end of each run (see
            ``trainer.collective_stats``). ``"timeline"`` records every collective call
            on every rank and writes them, merged, as one Chrome trace
            (``collective-timeline-<stage>.json`` in the run's log directory; see
            docs/debugging-hangs.md).
        preemption_signals: signals that stop the fit cleanly (default ``SIGTERM``; add
            ``"SIGUSR1"`` for SLURM's ``--signal``; ``None`` or ``[]``: none). On any
            rank, at the next optimizer step every rank saves one checkpoint and the
            process exits with `accord.errors.PREEMPTED_EXIT_CODE` (see
            [Preemption](../preemption.md)).
        on_nonfinite: what every rank does when the loss is NaN or infinite on any rank:
            ``"raise"`` (`NonFiniteValueError`, the default), ``"skip_step"`` (no
            optimizer step, the window's gradients dropped) or ``"warn"`` (rank zero warns,
            training goes on).
        auto_resume: when the job was restarted (torchrun's ``--max-restarts``, a
            requeue) and ``fit`` got no ``ckpt_path``, resume from the newest finished
            checkpoint (as ``ckpt_path="last"``).
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: DevicesLike = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        max_epochs: int | None = None,
        max_steps: int = -1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int = 1,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        deterministic: bool = False,
        default_root_dir: str | Path | None = None,
        callbacks: Callback | Iterable[Callback] | None = None,
        logger: Logger | Iterable[Logger] | bool = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        log_every_n_steps: int = 50,
        profiler: str | None = None,
        preemption_signals: SignalLike | Iterable[SignalLike] | None = DEFAULT_PREEMPTION_SIGNALS,
        on_nonfinite: str = "raise",
        auto_resume: bool = True,
    ) -> None:
        check_positive("accumulate_grad_batches", accumulate_grad_batches)
        check_positive("check_val_every_n_epoch", check_val_every_n_epoch)
        check_positive("log_every_n_steps", log_every_n_steps)
        if max_epochs is not None and max_epochs < 0:
            raise ConfigurationError(f"max_epochs={max_epochs} must be >= 0 (or None).")
        if max_steps < -1:
            raise ConfigurationError(f"max_steps={max_steps} must be -1 (no limit) or >= 0.")
        if gradient_clip_val is not None and gradient_clip_val <= 0:
            raise ConfigurationError(f"gradient_clip_val={gradient_clip_val} must be > 0.")
        for name, value in (
            ("limit_train_batches", limit_train_batches),
            ("limit_val_batches", limit_val_batches),
            ("limit_test_batches", limit_test_batches),
            ("limit_predict_batches", limit_predict_batches),
            ("val_check_interval", val_check_interval),
        ):
            check_limit(name, value)

        if profiler not in (None, "collectives", "timeline"):
            raise ConfigurationError(
                f"profiler={profiler!r} is not known; use 'collectives', 'timeline' or None."
            )
        self.preemption_signals = parse_signals(preemption_signals)
        self.on_nonfinite = check_nonfinite_mode(on_nonfinite)
        self.auto_resume = auto_resume
        self.strategy = connect(strategy, accelerator, devices, num_nodes, precision)
        self.profiler = profiler
        self.collective_stats_by_rank: list[dict[str, dict[str, float]]] = []
        self.max_epochs = 1000 if max_epochs is None and max_steps == -1 else max_epochs
        self.max_steps = max_steps
        self.limits = {
            "train": limit_train_batches,
            "validate": limit_val_batches,
            "test": limit_test_batches,
            "predict": limit_predict_batches,
        }
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.deterministic = deterministic
        self.default_root_dir = Path(default_root_dir) if default_root_dir else Path.cwd()
        self.log_every_n_steps = log_every_n_steps
        self.callbacks = build_callbacks(callbacks, enable_progress_bar, enable_checkpointing)
        self.loggers = build_loggers(logger, self.default_root_dir)

        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.stage = "fit"
        self.has_validation = False
        self.num_training_batches = 0
        self.num_eval_batches = 0
        self.datamodule: DataModule | None = None
        # The step the loggers record: optimizer steps done before the current batch,
        # so the first logged step is 0 as in Lightning.
        self.logger_step = 0
        self._state = RunState()

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
    def world_size(self) -> int:
        """Processes taking part."""
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank zero."""
        return self.strategy.is_global_zero

    @property
    def model(self) -> Module | None:
        """The user's module of the current (or last) run."""
        return self._state.module

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the current fit."""
        return self._state.optimizers

    @property
    def model_wrapper(self) -> torch.nn.Module | None:
        """The module as the strategy wrapped it, during a run (None outside one)."""
        return self._state.wrapped

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """The LR schedulers of the current fit, with when each steps."""
        return self._state.schedulers

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

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint`, or None."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    # --------------------------------------------------------------- entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Iterable[Any] | DataModule | None = None,
        val_dataloaders: Iterable[Any] | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: DataModule | None = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` when given.

        ``ckpt_path`` is a path, ``"last"`` (the newest finished checkpoint in the
        `ModelCheckpoint` directories) or ``"best"`` (the `ModelCheckpoint`'s
        ``best_model_path``, set by this Trainer's fit).

        With ``datamodule`` (a `DataModule`, also accepted in place of
        ``train_dataloaders``) the loaders come from it, on each rank, after its
        ``prepare_data`` and ``setup("fit")``.

        Under ``ddp_spawn``/``ddp_fork`` the training runs in child processes; afterwards
        ``model`` holds rank zero's trained weights.
        """
        if isinstance(train_dataloaders, DataModule):
            datamodule = check_datamodule("fit", datamodule, None, train_dataloaders)
            train_dataloaders = None
        self.datamodule = check_datamodule("fit", train_dataloaders, val_dataloaders, datamodule)
        if self.datamodule is None:
            if train_dataloaders is None:
                train_dataloaders = module_loader(model, "train_dataloader")
            if val_dataloaders is None and overrides(model, "validation_step"):
                val_dataloaders = module_loader(model, "val_dataloader", required=False)
        if isinstance(model, Module) and not model.automatic_optimization:
            # Before any process starts, so a refusal is raised here, not by every rank.
            check_manual(self)
        self._launch("fit", model, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(
        self,
        model: Module,
        dataloaders: Iterable[Any] | DataModule | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: DataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation pass; return its epoch metrics.

        With ``ckpt_path`` (a path, ``"last"`` or ``"best"``, as in `fit`) the weights
        are loaded from that checkpoint first. With ``datamodule`` (also accepted in place
        of ``dataloaders``) the loader is its ``val_dataloader()``, after its ``setup``.
        """
        loader = self._eval_loader("validate", model, dataloaders, datamodule)
        result: list[dict[str, float]] = self._launch("validate", model, None, loader, ckpt_path)
        return result

    def test(
        self,
        model: Module,
        dataloaders: Iterable[Any] | DataModule | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: DataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test pass; return its epoch metrics (``ckpt_path`` and ``datamodule`` as
        in `validate`)."""
        loader = self._eval_loader("test", model, dataloaders, datamodule)
        result: list[dict[str, float]] = self._launch("test", model, None, loader, ckpt_path)
        return result

    def predict(
        self,
        model: Module,
        dataloaders: Iterable[Any] | DataModule | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: DataModule | None = None,
    ) -> list[Any]:
        """Return ``predict_step``'s output for every batch (this rank's share of the data).

        ``ckpt_path`` and ``datamodule`` as in `validate`.
        """
        loader = self._eval_loader("predict", model, dataloaders, datamodule)
        result: list[Any] = self._launch("predict", model, None, loader, ckpt_path)
        return result

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the full training state to ``path`` (every rank must call it).

        It holds the model and optimizer states, the schedulers, the loss scaler, every
        callback's state, the loop position (mid-epoch included) and the RNG state, so
        ``fit(ckpt_path=path)`` continues where this run was.
        """
        model = self._state.module
        if model is None or self._state.wrapped is None:
            raise ConfigurationError("save_checkpoint() works during a run (fit/validate/test).")
        checkpoint = checkpoint_state(self, self._state)
        model.on_save_checkpoint(checkpoint)
        self.strategy.save_checkpoint(checkpoint, path)

    # ------------------------------------------------------- rank zero's results
    def rank_zero_results(self, output: Any) -> RankZeroResults:
        """What this run leaves behind, for the process that launched the ranks.

        Args:
            output: what the run returned.
        """
        module = self._state.module
        assert module is not None
        return RankZeroResults(
            output=output,
            state_dict={k: v.detach().cpu() for k, v in module.state_dict().items()},
            callback_metrics=dict(self.callback_metrics),
            progress_bar_metrics=dict(self.progress_bar_metrics),
            logged_metrics=dict(self.logged_metrics),
            callbacks={cb.state_key: cb.state_dict() for cb in self.callbacks},
            current_epoch=self.current_epoch,
            global_step=self.global_step,
            collective_stats_by_rank=self.collective_stats_by_rank,
        )

    def apply_rank_zero_results(self, results: RankZeroResults) -> None:
        """Take rank zero's `RankZeroResults` into this process's model, callbacks and counters."""
        module = self._state.module
        if module is None:
            return
        module.load_state_dict(results.state_dict)
        metrics = self._state.metrics
        metrics.callback_metrics = results.callback_metrics
        metrics.progress_bar_metrics = results.progress_bar_metrics
        metrics.logged_metrics = results.logged_metrics
        for cb in self.callbacks:
            if cb.state_key in results.callbacks:
                cb.load_state_dict(results.callbacks[cb.state_key])
        self.current_epoch = results.current_epoch
        self.global_step = results.global_step
        self.collective_stats_by_rank = results.collective_stats_by_rank

    # ----------------------------------------------------------------- launching
    def _eval_loader(
        self,
        stage: str,
        model: Module,
        dataloaders: Iterable[Any] | DataModule | None,
        datamodule: DataModule | None,
    ) -> Iterable[Any] | None:
        """The loader of ``stage``; None when a `DataModule` gives it on each rank."""
        if isinstance(dataloaders, DataModule):
            datamodule = check_datamodule(stage, datamodule, None, dataloaders)
            dataloaders = None
        self.datamodule = check_datamodule(stage, dataloaders, None, datamodule)
        if self.datamodule is not None:
            return None
        hook = {"validate": "val", "test": "test", "predict": "predict"}[stage]
        return dataloaders or module_loader(model, f"{hook}_dataloader")

    def _launch(self, stage: str, model: Module, *args: Any) -> Any:
        if not isinstance(model, Module):
            raise ConfigurationError(
                f"Trainer.{stage}() needs an accord.Module, got {type(model).__name__}. "
                "Subclass accord.Module (a LightningModule ports by changing its base class)."
            )
        self._state.module = model
        launcher = self.strategy.launcher
        if launcher is None:
            return self._run(stage, model, *args)
        if launcher.runs_in_caller:
            return launcher.launch(self._run, stage, model, *args)
        results: RankZeroResults | None = launcher.launch(self._run_rank, stage, model, *args)
        if results is None:
            return None
        self.apply_rank_zero_results(results)
        return results.output

    def _run_rank(self, stage: str, model: Module, *args: Any) -> RankZeroResults | None:
        """`_run` in a rank the launcher started; local rank zero returns its results."""
        output = self._run(stage, model, *args)
        return self.rank_zero_results(output) if self.local_rank == 0 else None

    def __getstate__(self) -> dict[str, Any]:
        # The launching process keeps its own reference; children get a fresh copy.
        state = dataclasses.replace(self._state, wrapped=None, optimizers=[], schedulers=[])
        return {**self.__dict__, "_state": state}

    # ---------------------------------------------------------------------- run
    def _run(
        self,
        stage: str,
        model: Module,
        train_loader: Iterable[Any] | None,
        eval_loader: Iterable[Any] | None,
        ckpt_path: str | Path | None,
    ) -> Any:
        if stage == "fit" and ckpt_path is None:
            ckpt_path = restart_checkpoint(self)
        return run_stage(self, self._state, stage, model, train_loader, eval_loader, ckpt_path)
