"""`Trainer`: runs fit / validate / test / predict loops on any `Strategy`.

The Trainer never communicates itself: every cross-rank question goes to
``self.strategy`` (which asks its collective). Its arguments and properties are
Lightning's (docs/from-lightning.md has the table); its parts live beside it: the
argument checks (`arguments`), the launch of a run (`launch`), the per-rank run (`run`),
the loops (`fit_loop`, `training_epoch`, `evaluation_loop`), the data (`data`),
checkpoints (`checkpointing`) and the optimizers (`optimizers`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.callbacks.callback import Callback
from accord.core.strategy import Strategy
from accord.datamodule import DataModule
from accord.errors import ConfigurationError
from accord.loggers.logger import Logger
from accord.module import Module
from accord.trainer import arguments, launch, training_checkpoints
from accord.trainer.connector import connect
from accord.trainer.preemption import DEFAULT_PREEMPTION_SIGNALS, SignalLike, parse_signals
from accord.trainer.properties import TrainerProperties
from accord.trainer.rank_loss import check_rank_loss_mode
from accord.trainer.state import RankZeroResults, RunState
from accord.trainer.step_decision import check_nonfinite_mode

__all__ = ["Trainer"]


class Trainer(TrainerProperties):
    """Trains and evaluates a `Module` with a strategy.

    The arguments are Lightning's, with Lightning's meaning and defaults, plus three of
    accord's own at the end. docs/from-lightning.md lists each one.

    Args:
        accelerator: ``"cpu"``, ``"cuda"`` (``"gpu"``), ``"mps"``, ``"xla"``, ``"auto"`` or
            an `Accelerator`.
        strategy: a registered name (``"ddp"``, ``"ddp_spawn"``, ``"fsdp"``, ...; see
            `StrategyRegistry`), a `Strategy` instance, or ``"auto"``.
        devices: devices (processes, on CPU) per node: a count, ``"auto"``, ``-1`` or indices.
        num_nodes: machines taking part.
        precision: ``"32-true"`` (the default, unless a `Strategy` instance brings its own
            `Precision`), ``"bf16-mixed"``, ``"16-mixed"`` (CUDA), ``"bf16-true"`` or
            ``"16-true"``.
        logger: a `Logger`, a list of them, True or None (a `CSVLogger`) or False.
        callbacks: extra `Callback` objects.
        fast_dev_run: run this many batches (True: 1) of each loader, one epoch, no
            sanity check, no logging or checkpointing: a quick test of the code.
        max_epochs: stop after this many epochs (default 1000 when ``max_steps`` is unset;
            ``-1``: no limit).
        min_epochs: train at least this many epochs, even when a callback asks to stop.
        max_steps: stop after this many optimizer steps (``-1``: no limit).
        min_steps: take at least this many optimizer steps before a stop is honoured.
        max_time: stop after this much training time: ``"DD:HH:MM:SS"``, a `timedelta`
            or a dict of its keys (adds a `Timer`).
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches:
            batches per epoch: an int count, a float fraction, or None for all.
        overfit_batches: train and validate on this many (or this fraction of the)
            training batches, in order.
        val_check_interval: validate every this many training batches (int) or fraction of
            an epoch (float); default once per epoch.
        check_val_every_n_epoch: validate every this many epochs.
        num_sanity_val_steps: validation batches run before training to catch errors in
            the validation code early (default 2; ``-1``: all; ``0``: none).
        log_every_n_steps: how often step metrics go to the loggers (default 50).
        enable_checkpointing: add a default `ModelCheckpoint` unless one is given.
        enable_progress_bar: show a progress bar on global rank zero.
        enable_model_summary: print a `ModelSummary` when fit starts.
        accumulate_grad_batches: batches whose gradients add up to one optimizer step.
        gradient_clip_val: clip the gradients to this value.
        gradient_clip_algorithm: ``"norm"`` (total norm, the default) or ``"value"``.
        deterministic: use deterministic algorithms only (``"warn"``: warn where one is not).
        benchmark: set ``torch.backends.cudnn.benchmark`` (None: leave it, False when
            ``deterministic``).
        inference_mode: evaluate under `torch.inference_mode` instead of `torch.no_grad`
            where the strategy allows it.
        use_distributed_sampler: give each rank its share of a `DataLoader` through a
            `DistributedSampler` (False: keep the loader's own sampler).
        profiler: ``"collectives"`` (calls and time of every collective op, per rank) or
            ``"timeline"`` (every rank's collective calls as one Chrome trace); see
            docs/debugging-hangs.md.
        detect_anomaly: run training under `torch.autograd.detect_anomaly`.
        barebones: turn off everything that costs speed (logging, checkpointing, progress
            bar, model summary, sanity check), to measure the loop itself.
        plugins: a `Precision` and/or a `ClusterEnvironment`; other plugins are refused.
        sync_batchnorm: compute BatchNorm statistics over all ranks (through the
            strategy's collective, also on CPU).
        reload_dataloaders_every_n_epochs: ask the loader hooks (the module's or the
            datamodule's) for new loaders every this many epochs.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        enable_autolog_hparams: give the module's and datamodule's hyperparameters to the
            loggers when fit starts.
        model_registry: Lightning's model registry; accord has none (only None).
        preemption_signals: signals that stop the fit cleanly (default ``SIGTERM``; add
            ``"SIGUSR1"`` for SLURM's ``--signal``; ``None`` or ``[]``: none). On any
            rank, at the next optimizer step every rank saves one checkpoint and the
            process exits with `accord.errors.PREEMPTED_EXIT_CODE` (see
            [Preemption](../preemption.md)).
        on_nonfinite: what every rank does when the loss is NaN or infinite on any rank:
            ``"raise"`` (`NonFiniteValueError`, the default), ``"skip_step"`` (no
            optimizer step, the window's gradients dropped) or ``"warn"``.
        on_rank_loss: what the ranks do when one of them is lost (killed, crashed, frozen
            past the collective timeout): ``"fail"`` (the default: every rank stops with an
            error naming the lost one) or ``"continue"`` (DDP family only: the survivors
            regroup and train on, the same numbers as without the loss; see
            [Surviving rank loss](../rank-loss.md)).
        auto_resume: when the job was restarted (torchrun's ``--max-restarts``, a
            requeue) and ``fit`` got no ``ckpt_path``, resume from the newest finished
            checkpoint (as ``ckpt_path="last"``).

    Raises:
        ConfigurationError: an argument out of range or one accord cannot honour, with
            what to pass instead.
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: DevicesLike = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        logger: Logger | Iterable[Logger] | bool | None = None,
        callbacks: Callback | Iterable[Callback] | None = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: str | None = None,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | Path | None = None,
        enable_autolog_hparams: bool = True,
        model_registry: str | None = None,
        preemption_signals: SignalLike | Iterable[SignalLike] | None = DEFAULT_PREEMPTION_SIGNALS,
        on_nonfinite: str = "raise",
        on_rank_loss: str = "fail",
        auto_resume: bool = True,
    ) -> None:
        arguments.check_model_registry(model_registry)
        flags = dict(locals())
        if barebones:
            arguments.check_barebones(flags)
            enable_checkpointing = enable_progress_bar = enable_model_summary = False
            logger, log_every_n_steps, num_sanity_val_steps = False, 0, 0
        plugin_precision, environment = arguments.check_plugins(plugins)
        self.strategy = connect(strategy, accelerator, devices, num_nodes, precision)
        launch.apply_plugins(self.strategy, plugin_precision, environment)
        self._init_loop_settings(flags, num_sanity_val_steps)
        self._init_run_options(flags)
        self.default_root_dir = Path(default_root_dir) if default_root_dir else Path.cwd()
        quiet = bool(self.fast_dev_run)
        self.callbacks = arguments.build_callbacks(
            callbacks,
            progress=enable_progress_bar is not False,
            checkpointing=enable_checkpointing is not False and not quiet,
            model_summary=enable_model_summary is not False and not quiet,
            max_time=max_time,
        )
        self.loggers = [] if quiet else arguments.build_loggers(logger, self.default_root_dir)
        self.collective_stats_by_rank: list[dict[str, dict[str, float]]] = []
        self._init_counters()

    def _init_loop_settings(self, flags: dict[str, Any], sanity: int | None) -> None:
        """The loop's limits and intervals, with ``fast_dev_run``/``overfit_batches`` applied."""
        limits, log_every = arguments.loop_limits(flags, sanity)
        self.fast_dev_run: int | bool = flags["fast_dev_run"]
        self.overfit_batches = flags["overfit_batches"]
        self.limit_train_batches, self.limit_val_batches = limits.train, limits.val
        self.limit_test_batches, self.limit_predict_batches = limits.test, limits.predict
        self.max_epochs, self.max_steps = limits.max_epochs, limits.max_steps
        self.min_epochs, self.min_steps = flags["min_epochs"], flags["min_steps"]
        self.num_sanity_val_steps = limits.num_sanity_val_steps
        self.val_check_interval = limits.val_check_interval
        self.check_val_every_n_epoch = limits.check_val_every_n_epoch
        self.log_every_n_steps = log_every
        self.accumulate_grad_batches = flags["accumulate_grad_batches"]
        self.reload_dataloaders_every_n_epochs = flags["reload_dataloaders_every_n_epochs"]

    def _init_run_options(self, flags: dict[str, Any]) -> None:
        """Clipping, determinism, evaluation mode, sampling, profiling, signals."""
        clip_val = flags["gradient_clip_val"]
        self.gradient_clip_val = clip_val
        self.gradient_clip_algorithm = arguments.check_gradient_clipping(
            clip_val, flags["gradient_clip_algorithm"]
        )
        self.deterministic, self.benchmark = flags["deterministic"], flags["benchmark"]
        self.inference_mode = bool(flags["inference_mode"])
        self.detect_anomaly = bool(flags["detect_anomaly"])
        self.use_distributed_sampler = bool(flags["use_distributed_sampler"])
        self.sync_batchnorm, self.barebones = (
            bool(flags["sync_batchnorm"]),
            bool(flags["barebones"]),
        )
        arguments.check_profiler(flags["profiler"])
        self.profiler: str | None = flags["profiler"]
        self.preemption_signals = parse_signals(flags["preemption_signals"])
        self.on_nonfinite = check_nonfinite_mode(flags["on_nonfinite"])
        self.on_rank_loss = check_rank_loss_mode(flags["on_rank_loss"], self.strategy)
        self.auto_resume: bool = flags["auto_resume"]
        self.enable_autolog_hparams: bool = flags["enable_autolog_hparams"]

    def _init_counters(self) -> None:
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

    # --------------------------------------------------------------- entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Iterable[Any] | DataModule | None = None,
        val_dataloaders: Iterable[Any] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` when given.

        ``ckpt_path`` is a path, ``"last"`` (the newest finished checkpoint in the
        `ModelCheckpoint` directories) or ``"best"`` (the `ModelCheckpoint`'s
        ``best_model_path``, set by this Trainer's fit). Without loaders the module's (or
        the ``datamodule``'s) loader hooks give them, on each rank, after ``setup``.
        ``weights_only`` is accepted for Lightning's signature; accord always reads
        checkpoints with ``weights_only=True`` (False is refused).

        Under ``ddp_spawn``/``ddp_fork`` the training runs in child processes; afterwards
        ``model`` holds rank zero's trained weights.
        """
        launch.check_weights_only(weights_only)
        module, *loaders = launch.fit_loaders(
            self, model, train_dataloaders, val_dataloaders, datamodule
        )
        launch.launch(self, "fit", module, *loaders, ckpt_path)

    def validate(
        self,
        model: Module | None = None,
        dataloaders: Iterable[Any] | DataModule | None = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation pass; return its epoch metrics.

        With ``ckpt_path`` (a path, ``"last"`` or ``"best"``, as in `fit`) the weights
        are loaded from that checkpoint first. With ``datamodule`` (also accepted in place
        of ``dataloaders``) the loader is its ``val_dataloader()``, after its ``setup``.
        Without ``model`` the last fit's module is used. ``verbose``: print the metrics on
        rank zero.
        """
        launch.check_weights_only(weights_only)
        output: list[dict[str, float]] = launch.evaluate(
            self, "validate", model, dataloaders, datamodule, ckpt_path, verbose
        )
        return output

    def test(
        self,
        model: Module | None = None,
        dataloaders: Iterable[Any] | DataModule | None = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run one test pass; return its epoch metrics (arguments as in `validate`)."""
        launch.check_weights_only(weights_only)
        output: list[dict[str, float]] = launch.evaluate(
            self, "test", model, dataloaders, datamodule, ckpt_path, verbose
        )
        return output

    def predict(
        self,
        model: Module | None = None,
        dataloaders: Iterable[Any] | DataModule | None = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> list[Any] | None:
        """Return ``predict_step``'s output for every batch (this rank's share of the data).

        ``ckpt_path`` and ``datamodule`` as in `validate`. ``return_predictions=False``
        keeps no outputs and returns None.
        """
        launch.check_weights_only(weights_only)
        output = launch.evaluate(self, "predict", model, dataloaders, datamodule, ckpt_path, False)
        return None if return_predictions is False else output

    def save_checkpoint(
        self, filepath: str | Path, weights_only: bool = False, storage_options: Any = None
    ) -> None:
        """Write the full training state to ``filepath`` (every rank must call it).

        It holds the model and optimizer states, the schedulers, the loss scaler, every
        callback's state, the loop position (mid-epoch included) and the RNG state, so
        ``fit(ckpt_path=path)`` continues where this run was. ``weights_only=True`` writes
        the weights and hyperparameters only. ``storage_options`` is refused (accord
        writes to the file system, atomically).
        """
        if storage_options is not None:
            raise ConfigurationError(
                "save_checkpoint(storage_options=...) is not supported: accord writes "
                "checkpoints to a path on the file system, atomically."
            )
        training_checkpoints.save_checkpoint(self, filepath, weights_only=weights_only)

    # ------------------------------------------------------- rank zero's results
    def rank_zero_results(self, output: Any) -> RankZeroResults:
        """What this run leaves behind, for the process that launched the ranks.

        Args:
            output: what the run returned.
        """
        return launch.collect_results(self, output)

    def apply_rank_zero_results(self, results: RankZeroResults) -> None:
        """Take rank zero's `RankZeroResults` into this process's model, callbacks and counters."""
        launch.apply_results(self, results)

    # ----------------------------------------------------------------- launching
    def _run_rank(self, stage: str, model: Module, *args: Any) -> RankZeroResults | None:
        """`_run` in a rank the launcher started; local rank zero returns its results (with
        ``on_rank_loss="continue"`` every rank does: local rank zero may be lost)."""
        output = self._run(stage, model, *args)
        if self.local_rank == 0 or self.on_rank_loss == "continue":
            return self.rank_zero_results(output)
        return None

    def __getstate__(self) -> dict[str, Any]:
        # The launching process keeps its own reference; children get a fresh copy.
        return launch.picklable_state(self)

    def _run(self, stage: str, model: Module, *args: Any) -> Any:
        """Run ``stage`` in this process (see `launch.run`)."""
        return launch.run(self, stage, model, *args)
