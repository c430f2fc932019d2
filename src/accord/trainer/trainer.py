"""`Trainer`: runs fit / validate / test / predict loops on any `Strategy`.

The Trainer never communicates itself: every cross-rank question goes to
``self.strategy`` (which asks its collective). Its parts live beside it: the loops
(`run`, `loops`, `fit_loop`), the data (`data`), checkpoints (`checkpointing`), the
optimizers (`optimizers`) and the argument checks and launching (`plumbing`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.callbacks.callback import Callback
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.core.strategy import Strategy
from accord.datamodule import DataModule
from accord.loggers.logger import Logger
from accord.module import Module
from accord.trainer import plumbing
from accord.trainer.arguments import build_callbacks, build_loggers
from accord.trainer.compile import unwrap_compiled
from accord.trainer.connector import connect
from accord.trainer.metrics import MetricStore
from accord.trainer.optimizers import SchedulerConfig
from accord.trainer.preemption import DEFAULT_PREEMPTION_SIGNALS, SignalLike, parse_signals
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
        plumbing.check_counts(accumulate_grad_batches, check_val_every_n_epoch, log_every_n_steps)
        plumbing.check_bounds(max_epochs, max_steps, gradient_clip_val)
        lim = (limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches)
        plumbing.check_limits(*lim, val_check_interval)
        plumbing.check_profiler(profiler)
        self.preemption_signals = parse_signals(preemption_signals)
        self.on_nonfinite = check_nonfinite_mode(on_nonfinite)
        self.auto_resume = auto_resume
        self.strategy = connect(strategy, accelerator, devices, num_nodes, precision)
        self.profiler = profiler
        self.collective_stats_by_rank: list[dict[str, dict[str, float]]] = []
        self.max_epochs = 1000 if max_epochs is None and max_steps == -1 else max_epochs
        self.max_steps = max_steps
        self.limits = dict(zip(("train", "validate", "test", "predict"), lim, strict=True))
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
        model = unwrap_compiled(model, self.strategy)
        loaders = plumbing.fit_loaders(self, model, train_dataloaders, val_dataloaders, datamodule)
        plumbing.launch(self, "fit", model, *loaders, ckpt_path)

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
        model = unwrap_compiled(model, self.strategy)
        return plumbing.evaluate(self, "validate", model, dataloaders, datamodule, ckpt_path)

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
        model = unwrap_compiled(model, self.strategy)
        return plumbing.evaluate(self, "test", model, dataloaders, datamodule, ckpt_path)

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
        model = unwrap_compiled(model, self.strategy)
        return plumbing.evaluate(self, "predict", model, dataloaders, datamodule, ckpt_path)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the full training state to ``path`` (every rank must call it).

        It holds the model and optimizer states, the schedulers, the loss scaler, every
        callback's state, the loop position (mid-epoch included) and the RNG state, so
        ``fit(ckpt_path=path)`` continues where this run was.
        """
        plumbing.save_checkpoint(self, path)

    # ------------------------------------------------------- rank zero's results
    def rank_zero_results(self, output: Any) -> RankZeroResults:
        """What this run leaves behind, for the process that launched the ranks.

        Args:
            output: what the run returned.
        """
        return plumbing.collect_results(self, output)

    def apply_rank_zero_results(self, results: RankZeroResults) -> None:
        """Take rank zero's `RankZeroResults` into this process's model, callbacks and counters."""
        plumbing.apply_results(self, results)

    # ----------------------------------------------------------------- launching
    def _run_rank(self, stage: str, model: Module, *args: Any) -> RankZeroResults | None:
        """`_run` in a rank the launcher started; local rank zero returns its results."""
        output = self._run(stage, model, *args)
        return self.rank_zero_results(output) if self.local_rank == 0 else None

    def __getstate__(self) -> dict[str, Any]:
        # The launching process keeps its own reference; children get a fresh copy.
        return plumbing.picklable_state(self)

    # ---------------------------------------------------------------------- run
    def _run(self, stage: str, model: Module, *args: Any) -> Any:
        """Run ``stage`` in this process (see `plumbing.run`)."""
        return plumbing.run(self, stage, model, *args)
