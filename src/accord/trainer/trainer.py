"""`Trainer`: runs fit / validate / test / predict loops on any `Strategy`.

The Trainer never communicates itself: every cross-rank question goes to
``self.strategy`` (which asks its collective).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.callbacks.callback import Callback
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.progress import ProgressBar
from accord.core.strategy import RunSettings, Strategy
from accord.errors import CheckpointError, ConfigurationError
from accord.launchers.multiprocessing import MultiprocessingLauncher
from accord.loggers.csv import CSVLogger
from accord.loggers.logger import Logger
from accord.module import Module
from accord.trainer.connector import connect
from accord.trainer.metrics import MetricStore

__all__ = ["Trainer"]

_CHECKPOINT_VERSION = 1


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
            ``trainer.collective_stats``).
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
    ) -> None:
        _check_positive("accumulate_grad_batches", accumulate_grad_batches)
        _check_positive("check_val_every_n_epoch", check_val_every_n_epoch)
        _check_positive("log_every_n_steps", log_every_n_steps)
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
            _check_limit(name, value)

        if profiler not in (None, "collectives"):
            raise ConfigurationError(
                f"profiler={profiler!r} is not known; use 'collectives' or None."
            )
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
        self.callbacks = _callbacks(callbacks, enable_progress_bar, enable_checkpointing)
        self.loggers = _loggers(logger, self.default_root_dir)

        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.stage = "fit"
        self.has_validation = False
        self.num_training_batches = 0
        self.num_eval_batches = 0
        self._metrics = MetricStore()
        self._module: Module | None = None
        self._wrapped: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[dict[str, Any]] = []
        self._batches_done = 0
        self._skip_batches = 0
        self._rng_epoch_start: torch.Tensor | None = None
        self._resume_rng: tuple[torch.Tensor | None, torch.Tensor] | None = None
        # Whether this epoch's epoch-interval schedulers have stepped: a checkpoint taken at
        # the end of an epoch but before they did (after validation) must step them on resume.
        self._epoch_schedulers_stepped = False
        self._window_has_backward = False
        self._warned_all_skipped = False

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
        return self._module

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the current fit."""
        return self._optimizers

    @property
    def logger(self) -> Logger | None:
        """The first logger, or None."""
        return self.loggers[0] if self.loggers else None

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric."""
        return self._metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The latest value of every ``prog_bar=True`` metric."""
        return self._metrics.progress_bar_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The latest value of every metric sent to the loggers (``logger=True``).

        Names are as the loggers see them: a metric logged with ``on_step=True,
        on_epoch=True`` appears as ``<name>_step`` and ``<name>_epoch``. Step values are
        included every ``log_every_n_steps`` steps, as the loggers get them; the dict is
        kept even when the Trainer has no logger.
        """
        return self._metrics.logged_metrics

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint`, or None."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    # --------------------------------------------------------------- entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Iterable[Any] | None = None,
        val_dataloaders: Iterable[Any] | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` (a file, or ``"last"``) when given.

        Under ``ddp_spawn``/``ddp_fork`` the training runs in child processes; afterwards
        ``model`` holds rank zero's trained weights.
        """
        if train_dataloaders is None:
            train_dataloaders = _module_loader(model, "train_dataloader")
        if val_dataloaders is None and _overrides(model, "validation_step"):
            val_dataloaders = _module_loader(model, "val_dataloader", required=False)
        self._launch("fit", model, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(
        self,
        model: Module,
        dataloaders: Iterable[Any] | None = None,
        ckpt_path: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation pass; return its epoch metrics."""
        loader = dataloaders or _module_loader(model, "val_dataloader")
        result: list[dict[str, float]] = self._launch("validate", model, None, loader, ckpt_path)
        return result

    def test(
        self,
        model: Module,
        dataloaders: Iterable[Any] | None = None,
        ckpt_path: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """Run one test pass; return its epoch metrics."""
        loader = dataloaders or _module_loader(model, "test_dataloader")
        result: list[dict[str, float]] = self._launch("test", model, None, loader, ckpt_path)
        return result

    def predict(
        self,
        model: Module,
        dataloaders: Iterable[Any] | None = None,
        ckpt_path: str | Path | None = None,
    ) -> list[Any]:
        """Return ``predict_step``'s output for every batch (this rank's share of the data)."""
        loader = dataloaders or _module_loader(model, "predict_dataloader")
        result: list[Any] = self._launch("predict", model, None, loader, ckpt_path)
        return result

    # ----------------------------------------------------------------- launching
    def _launch(self, stage: str, model: Module, *args: Any) -> Any:
        if not isinstance(model, Module):
            raise ConfigurationError(
                f"Trainer.{stage}() needs an accord.Module, got {type(model).__name__}. "
                "Subclass accord.Module (a LightningModule ports by changing its base class)."
            )
        self._module = model
        launcher = self.strategy.launcher
        if launcher is None:
            return self._run(stage, model, *args)
        if isinstance(launcher, MultiprocessingLauncher):
            launcher.owner = self
        return launcher.launch(self._run, stage, model, *args)

    def __getstate__(self) -> dict[str, Any]:
        # The launching process keeps its own reference; children get a fresh copy.
        return {**self.__dict__, "_wrapped": None, "_optimizers": [], "_schedulers": []}

    def _rank_zero_payload(self) -> dict[str, Any]:
        module = self._module
        assert module is not None
        return {
            "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "callback_metrics": dict(self.callback_metrics),
            "progress_bar_metrics": dict(self.progress_bar_metrics),
            "logged_metrics": dict(self.logged_metrics),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "current_epoch": self.current_epoch,
            "global_step": self.global_step,
            "collective_stats_by_rank": self.collective_stats_by_rank,
        }

    def _apply_rank_zero_payload(self, payload: dict[str, Any] | None) -> None:
        if payload is None or self._module is None:
            return
        self._module.load_state_dict(payload["state_dict"])
        self._metrics.callback_metrics = payload["callback_metrics"]
        self._metrics.progress_bar_metrics = payload["progress_bar_metrics"]
        self._metrics.logged_metrics = payload["logged_metrics"]
        for cb in self.callbacks:
            if cb.state_key in payload["callbacks"]:
                cb.load_state_dict(payload["callbacks"][cb.state_key])
        self.current_epoch = payload["current_epoch"]
        self.global_step = payload["global_step"]
        self.collective_stats_by_rank = payload["collective_stats_by_rank"]

    # ---------------------------------------------------------------------- run
    def _run(
        self,
        stage: str,
        model: Module,
        train_loader: Iterable[Any] | None,
        eval_loader: Iterable[Any] | None,
        ckpt_path: str | Path | None,
    ) -> Any:
        self.stage = stage
        self._module = model
        strategy = self.strategy
        if self.profiler == "collectives":
            strategy.enable_collective_stats().reset()
        strategy.setup_environment()
        if self.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        model.trainer = self
        strategy.configure_run(
            RunSettings(
                accumulate_grad_batches=self.accumulate_grad_batches,
                gradient_clip_val=self.gradient_clip_val,
            )
        )
        self._metrics = MetricStore()
        try:
            self._call_callbacks("setup", stage)
            model.setup(stage)
            self._wrapped = strategy.setup_module(model)
            if stage == "fit":
                optimizers, self._schedulers = _configure_optimizers(model)
                self._optimizers = strategy.setup_optimizers(self._wrapped, optimizers)
            if ckpt_path is not None:
                self._restore(ckpt_path, stage)
            result = self._dispatch(stage, train_loader, eval_loader)
            if self.profiler == "collectives":
                self._report_collective_stats()
            for logger in self._rank_zero_loggers():
                logger.finalize("success")
            return result
        except BaseException as err:
            for cb in self.callbacks:
                cb.on_exception(self, model, err)
            for logger in self._rank_zero_loggers():
                logger.finalize("failed")
            raise
        finally:
            model.teardown(stage)
            self._call_callbacks("teardown", stage)
            self._wrapped = None
            strategy.teardown()

    def _dispatch(
        self, stage: str, train_loader: Iterable[Any] | None, eval_loader: Iterable[Any] | None
    ) -> Any:
        if stage == "fit":
            assert train_loader is not None
            self._fit(self._prepare_loader(train_loader, "train"), eval_loader)
            return None
        assert eval_loader is not None
        loader = self._prepare_loader(eval_loader, stage)
        if stage == "predict":
            return self._predict(loader)
        return [self._evaluate(stage, loader)]

    def _report_collective_stats(self) -> None:
        self.collective_stats_by_rank = self.strategy.gather_collective_stats()
        if self.is_global_zero:
            for rank, summary in enumerate(self.collective_stats_by_rank):
                calls = sum(int(row["calls"]) for row in summary.values())
                print(f"\nrank {rank}: {calls} collective calls during {self.stage}")
                for op, row in summary.items():
                    print(
                        f"  {op:<18} {int(row['calls']):>7} calls  {row['seconds']:9.4f} s  "
                        f"{row['mean_ms']:8.3f} ms/call"
                    )

    def _rank_zero_loggers(self) -> list[Logger]:
        return self.loggers if self.is_global_zero else []

    def _call_callbacks(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, self._module, *args)

    def _log(self, metrics: Mapping[str, float]) -> None:
        if metrics:
            self._metrics.logged_metrics.update(metrics)
            for logger in self._rank_zero_loggers():
                logger.log_metrics(metrics, self.global_step)

    # ---------------------------------------------------------------- data
    def _prepare_loader(self, loader: Iterable[Any], stage: str) -> Iterable[Any]:
        """Give a multi-rank run a `DistributedSampler`, so each rank sees its own share."""
        kwargs = self.strategy.distributed_sampler_kwargs
        if kwargs is None or kwargs["num_replicas"] == 1 or not isinstance(loader, DataLoader):
            return loader
        if isinstance(loader.dataset, IterableDataset) or isinstance(
            _sampler_of(loader), DistributedSampler
        ):
            return loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
            raise ConfigurationError(
                f"The {stage} DataLoader uses a custom batch_sampler "
                f"({type(batch_sampler).__name__}), which accord cannot shard across ranks. "
                "Shard it yourself: build it over a DistributedSampler(dataset, "
                "num_replicas=trainer.world_size, rank=trainer.global_rank)."
            )
        # A batch_sampler the user passed (batch_size is then None) keeps its batch size and
        # drop_last; only the sampler inside it is replaced by this rank's shard.
        given = batch_sampler if loader.batch_size is None else None
        inner = given.sampler if given is not None else loader.sampler
        shuffle = stage == "train" and isinstance(inner, RandomSampler)
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, shuffle=shuffle, drop_last=False, **kwargs
        )
        extra: dict[str, Any] = {}
        if loader.num_workers > 0:
            extra = {
                "prefetch_factor": loader.prefetch_factor,
                "persistent_workers": loader.persistent_workers,
            }
        if given is not None:
            extra["batch_sampler"] = BatchSampler(sampler, given.batch_size, given.drop_last)
        else:
            extra.update(batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)
        return DataLoader(
            loader.dataset,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            **extra,
        )

    def _num_batches(self, loader: Iterable[Any], stage: str) -> int:
        try:
            available = len(loader)  # type: ignore[arg-type]
        except TypeError:
            available = math.inf  # type: ignore[assignment]
        limit = self.limits.get(stage)
        if limit is None:
            count = available
        elif isinstance(limit, float):
            count = int(available * limit) if available != math.inf else available
        else:
            count = min(limit, available)
        return int(count) if count != math.inf else 2**62

    # ----------------------------------------------------------------- fit loop
    def _fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        model, strategy = self._module, self.strategy
        assert model is not None and self._wrapped is not None
        if val_loader is not None:
            val_loader = self._prepare_loader(val_loader, "validate")
        self.has_validation = (
            val_loader is not None
            and _overrides(model, "validation_step")
            and self.limits["validate"] != 0
        )
        self.num_training_batches = self._num_batches(train_loader, "train")
        self.should_stop = False
        self._window_has_backward = False
        self._warned_all_skipped = False
        self._call_callbacks("on_fit_start")
        model.on_fit_start()
        model.on_train_start()
        while not self._fit_done():
            _set_epoch(train_loader, self.current_epoch)
            model.train()
            self._metrics.stage = "train"
            self._call_callbacks("on_train_epoch_start")
            model.on_train_epoch_start()
            self._epoch_schedulers_stepped = False
            self._train_epoch(train_loader, val_loader)
            model.on_train_epoch_end()
            self._log(self._metrics.flush_epoch(strategy, "train"))
            # Before the callbacks, so a checkpoint saved at the end of the epoch holds the
            # schedulers as the next epoch starts with them (as Lightning's does).
            self._step_schedulers("epoch", self.current_epoch)
            self._epoch_schedulers_stepped = True
            self._call_callbacks("on_train_epoch_end")
            self.current_epoch += 1
            self._batches_done = 0
            if self.should_stop:
                break
        model.on_train_end()
        self._call_callbacks("on_fit_end")
        model.on_fit_end()

    def _fit_done(self) -> bool:
        if self.max_steps != -1 and self.global_step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.current_epoch >= self.max_epochs

    def _epoch_batches(self, loader: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        # On resume, the RNG is put back where the interrupted run had it when this epoch's
        # iterator was made (so a shuffled order repeats), then where it was at the save.
        resume, self._resume_rng = self._resume_rng, None
        if resume is not None:
            start, at_save = resume
            torch.set_rng_state(start if start is not None else at_save)
        self._rng_epoch_start = torch.get_rng_state()
        iterator = iter(loader)
        skip, self._skip_batches = self._skip_batches, 0
        for _ in range(skip):
            next(iterator, None)
        if resume is not None and resume[0] is not None:
            torch.set_rng_state(resume[1])
        for batch_idx, batch in enumerate(iterator, start=skip):
            if batch_idx >= self.num_training_batches:
                return
            yield batch_idx, batch

    def _train_epoch(self, loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        model, strategy, wrapped = self._module, self.strategy, self._wrapped
        assert model is not None and wrapped is not None
        accumulate = self.accumulate_grad_batches
        total = self.num_training_batches
        val_every = self._val_every(total)
        multi_rank = strategy.world_size > 1
        ran = skipped = 0
        for batch_idx, batch in self._epoch_batches(loader):
            batch = strategy.batch_to_device(batch)
            strategy.on_train_batch_start(batch_idx, last=batch_idx + 1 == total)
            model.on_train_batch_start(batch, batch_idx)
            is_step = (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == total
            with strategy.no_backward_sync(wrapped, enabled=not is_step):
                self._metrics.in_step = True
                with strategy.forward_context():
                    output = strategy.step(wrapped, "training_step", batch, batch_idx)
                self._metrics.in_step = False
                loss = _loss_of(output)
                # A step one rank skips is skipped by all: a rank that went on to backward
                # alone would wait for the others' gradients forever.
                if multi_rank and strategy.reduce_boolean_decision(loss is None, all=False):
                    loss = None
                self._metrics.end_training_step(skipped=loss is None)
                ran += 1
                if loss is None:
                    skipped += 1
                else:
                    if accumulate > 1:
                        loss = loss / accumulate
                    model.on_before_backward(loss)
                    strategy.backward(loss, wrapped)
                    model.on_after_backward()
                    self._window_has_backward = True
            if is_step:
                self._optimizer_step()
            step_metrics = self._metrics.flush_step(strategy)
            if is_step and self.global_step % self.log_every_n_steps == 0:
                self._log(step_metrics)
            self._batches_done = batch_idx + 1
            self._call_callbacks("on_train_batch_end", output, batch, batch_idx)
            model.on_train_batch_end(output, batch, batch_idx)
            if val_loader is not None and self._should_validate(batch_idx, val_every):
                self._evaluate("validate", val_loader)
                model.train()
                self._metrics.stage = "train"
            if self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps):
                break
        if ran and skipped == ran and not self._warned_all_skipped:
            self._warned_all_skipped = True
            if self.is_global_zero:
                warnings.warn(
                    f"training_step returned None for every batch of epoch {self.current_epoch}"
                    f"{' on at least one rank' if multi_rank else ''}, so nothing was trained. "
                    "Return the loss (a tensor, or a dict with a 'loss' key); return None only "
                    "to skip a batch on purpose.",
                    UserWarning,
                    stacklevel=2,
                )

    def _val_every(self, total: int) -> int:
        interval = self.val_check_interval
        if interval is None:
            return total
        if isinstance(interval, float):
            return max(1, int(total * interval))
        return interval

    def _should_validate(self, batch_idx: int, every: int) -> bool:
        if not self.has_validation or (self.current_epoch + 1) % self.check_val_every_n_epoch:
            return False
        return (batch_idx + 1) % every == 0

    def _optimizer_step(self) -> None:
        model, strategy, wrapped = self._module, self.strategy, self._wrapped
        assert model is not None and wrapped is not None
        # A window whose every batch was skipped has no gradients: nothing to apply. The
        # step still counts, as in Lightning, so max_steps and step schedulers advance.
        if self._window_has_backward:
            for optimizer in self._optimizers:
                if self.gradient_clip_val is not None:
                    strategy.clip_gradients(wrapped, optimizer, self.gradient_clip_val)
                else:
                    strategy.precision.unscale_gradients(optimizer)
                model.on_before_optimizer_step(optimizer)
                strategy.optimizer_step(optimizer, wrapped)
                strategy.zero_grad(optimizer, wrapped)
        self._window_has_backward = False
        self.global_step += 1
        self._step_schedulers("step", self.current_epoch)

    def _step_schedulers(
        self, interval: str, epoch: int, monitored: Mapping[str, Any] | None = None
    ) -> None:
        """Step the ``interval`` schedulers due now; ``epoch`` is the epoch that ends.

        ``monitored`` replaces ``callback_metrics`` as the source of monitored values (on
        resume, the values saved with the checkpoint).
        """
        metrics = self.callback_metrics if monitored is None else monitored
        count = self.global_step if interval == "step" else epoch + 1
        for config in self._schedulers:
            if config["interval"] != interval or count % config["frequency"]:
                continue
            scheduler = config["scheduler"]
            monitor = config.get("monitor")
            if monitor is not None:
                value = metrics.get(monitor)
                if value is None:
                    raise ConfigurationError(
                        f"The LR scheduler monitors {monitor!r}, which was not logged. Logged: "
                        f"{sorted(metrics)}."
                    )
                scheduler.step(float(value))
            else:
                scheduler.step()

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def _evaluate(self, stage: str, loader: Iterable[Any]) -> dict[str, float]:
        model, strategy, wrapped = self._module, self.strategy, self._wrapped
        assert model is not None and wrapped is not None
        hook = "validation_step" if stage == "validate" else "test_step"
        epoch_start, epoch_end = (
            ("on_validation_epoch_start", "on_validation_epoch_end")
            if stage == "validate"
            else ("on_test_epoch_start", "on_test_epoch_end")
        )
        limit_key = "validate" if stage == "validate" else "test"
        self.num_eval_batches = self._num_batches(loader, limit_key)
        was_training = model.training
        model.eval()
        self._metrics.stage = stage
        self._metrics.reset(stage)
        self._call_callbacks("on_validation_start" if stage == "validate" else "on_test_start")
        getattr(model, epoch_start)()
        batch_hook = "on_validation_batch_end" if stage == "validate" else "on_test_batch_end"
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= self.num_eval_batches:
                break
            batch = strategy.batch_to_device(batch)
            self._metrics.in_step = True
            with strategy.forward_context():
                output = strategy.step(wrapped, hook, batch, batch_idx)
            self._metrics.in_step = False
            self._metrics.flush_step(strategy)
            self._call_callbacks(batch_hook, output, batch, batch_idx)
        getattr(model, epoch_end)()
        metrics = self._metrics.flush_epoch(strategy, stage)
        self._log(metrics)
        if stage == "validate":
            self._call_callbacks("on_validation_end")
        model.train(was_training)
        return metrics

    @torch.no_grad()
    def _predict(self, loader: Iterable[Any]) -> list[Any]:
        model, strategy, wrapped = self._module, self.strategy, self._wrapped
        assert model is not None and wrapped is not None
        self.num_eval_batches = self._num_batches(loader, "predict")
        model.eval()
        self._metrics.stage = "predict"
        self._call_callbacks("on_predict_start")
        outputs = []
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= self.num_eval_batches:
                break
            batch = strategy.batch_to_device(batch)
            with strategy.forward_context():
                output = strategy.step(wrapped, "predict_step", batch, batch_idx)
            outputs.append(output)
            self._call_callbacks("on_predict_batch_end", output, batch, batch_idx)
        return outputs

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | Path) -> None:
        """Write the full training state to ``path`` (every rank must call it).

        It holds the model and optimizer states, the schedulers, the loss scaler, every
        callback's state, the loop position (mid-epoch included) and the RNG state, so
        ``fit(ckpt_path=path)`` continues where this run was.
        """
        model, wrapped = self._module, self._wrapped
        if model is None or wrapped is None:
            raise ConfigurationError("save_checkpoint() works during a run (fit/validate/test).")
        strategy = self.strategy
        epoch_finished = self._batches_done >= self.num_training_batches
        monitors = {c["monitor"] for c in self._schedulers if c.get("monitor") is not None}
        checkpoint: dict[str, Any] = {
            "accord_checkpoint_version": _CHECKPOINT_VERSION,
            "epoch": self.current_epoch,
            "global_step": self.global_step,
            "batches_done": self._batches_done,
            "epoch_finished": epoch_finished,
            # Saved after the epoch's last batch but before its schedulers stepped (a save
            # after validation): the resume steps them, with the values they monitor now.
            "epoch_schedulers_pending": epoch_finished and not self._epoch_schedulers_stepped,
            "scheduler_monitors": {
                name: float(value)
                for name, value in self.callback_metrics.items()
                if name in monitors
            },
            "state_dict": strategy.module_state_dict(wrapped),
            "optimizer_states": [strategy.optimizer_state_dict(o) for o in self._optimizers],
            "lr_schedulers": [c["scheduler"].state_dict() for c in self._schedulers],
            "precision": strategy.precision.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "rng_epoch_start": self._rng_epoch_start,
            "rng": torch.get_rng_state(),
        }
        model.on_save_checkpoint(checkpoint)
        strategy.save_checkpoint(checkpoint, path)

    def _resolve_ckpt_path(self, ckpt_path: str | Path) -> Path:
        if str(ckpt_path) != "last":
            return Path(ckpt_path)
        callback = self.checkpoint_callback
        directory = (
            callback.dirpath
            if callback is not None and callback.dirpath is not None
            else self.default_root_dir / "checkpoints"
        )
        candidates = sorted(Path(directory).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise CheckpointError(
                f"ckpt_path='last' but there is no checkpoint in {str(directory)!r}. Train "
                "first, or pass the path of a checkpoint."
            )
        return candidates[-1]

    def _restore(self, ckpt_path: str | Path, stage: str) -> None:
        model, wrapped, strategy = self._module, self._wrapped, self.strategy
        assert model is not None and wrapped is not None
        path = self._resolve_ckpt_path(ckpt_path)
        checkpoint = strategy.load_checkpoint(path)
        if "state_dict" not in checkpoint:
            raise CheckpointError(f"{str(path)!r} is not an accord checkpoint (no 'state_dict').")
        try:
            strategy.load_module_state_dict(wrapped, checkpoint["state_dict"])
        except RuntimeError as err:
            raise CheckpointError(
                f"{str(path)!r} does not fit {type(model).__name__}: it was saved from a "
                f"different model or configuration.\n{err}"
            ) from err
        model.on_load_checkpoint(checkpoint)
        if stage != "fit":
            return
        states = checkpoint.get("optimizer_states", [])
        if len(states) != len(self._optimizers):
            raise CheckpointError(
                f"{str(path)!r} holds {len(states)} optimizer state(s) but "
                f"configure_optimizers() returned {len(self._optimizers)}."
            )
        for optimizer, state in zip(self._optimizers, states, strict=True):
            strategy.load_optimizer_state_dict(optimizer, state)
        for config, state in zip(
            self._schedulers, checkpoint.get("lr_schedulers", []), strict=False
        ):
            config["scheduler"].load_state_dict(state)
        finished = bool(checkpoint.get("epoch_finished", True))
        if finished and checkpoint.get("epoch_schedulers_pending", False):
            self._step_schedulers(
                "epoch", int(checkpoint["epoch"]), checkpoint.get("scheduler_monitors", {})
            )
        strategy.precision.load_state_dict(checkpoint.get("precision", {}))
        for cb in self.callbacks:
            if cb.state_key in checkpoint.get("callbacks", {}):
                cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
        self.global_step = int(checkpoint["global_step"])
        epoch = int(checkpoint["epoch"])
        if finished:
            self.current_epoch = epoch + 1
            self._skip_batches = 0
            self._resume_rng = (None, checkpoint["rng"]) if "rng" in checkpoint else None
        else:
            self.current_epoch = epoch
            self._skip_batches = int(checkpoint["batches_done"])
            start = checkpoint.get("rng_epoch_start")
            self._resume_rng = (start, checkpoint["rng"]) if "rng" in checkpoint else None
        self._batches_done = self._skip_batches


# -------------------------------------------------------------------- helpers
def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1.")


def _check_limit(name: str, value: int | float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{name}={value!r} must be an int count, a float fraction, or None."
        )
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ConfigurationError(
            f"{name}={value} is a fraction outside [0, 1]. Pass an int for a number of batches."
        )
    if value < 0:
        raise ConfigurationError(f"{name}={value} must be >= 0.")


def _callbacks(
    callbacks: Callback | Iterable[Callback] | None, progress: bool, checkpointing: bool
) -> list[Callback]:
    if callbacks is None:
        result: list[Callback] = []
    elif isinstance(callbacks, Callback):
        result = [callbacks]
    else:
        result = list(callbacks)
    for cb in result:
        if not isinstance(cb, Callback):
            raise ConfigurationError(
                f"callbacks must be accord.callbacks.Callback objects, got {type(cb).__name__}."
            )
    if progress and not any(isinstance(cb, ProgressBar) for cb in result):
        result.append(ProgressBar())
    if checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in result):
        result.append(ModelCheckpoint())
    return result


def _loggers(logger: Logger | Iterable[Logger] | bool, root: Path) -> list[Logger]:
    if logger is True:
        return [CSVLogger(root)]
    if logger is False:
        return []
    if isinstance(logger, Logger):
        return [logger]
    loggers = list(logger)
    for item in loggers:
        if not isinstance(item, Logger):
            raise ConfigurationError(f"logger must be a Logger, got {type(item).__name__}.")
    return loggers


def _overrides(model: Module, name: str) -> bool:
    return getattr(type(model), name, None) is not getattr(Module, name, None)


def _module_loader(model: Module, name: str, required: bool = True) -> Any:
    method = getattr(model, name, None)
    if callable(method):
        return method()
    if required:
        raise ConfigurationError(
            f"No dataloader given and {type(model).__name__} has no {name}(). Pass one to the "
            "Trainer method, or define the method on the module."
        )
    return None


def _sampler_of(loader: Iterable[Any]) -> Any:
    """The sampler that orders a loader's samples: inside a batch_sampler the user gave."""
    if getattr(loader, "batch_size", 0) is None:
        return getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return getattr(loader, "sampler", None)


def _set_epoch(loader: Iterable[Any], epoch: int) -> None:
    set_epoch = getattr(_sampler_of(loader), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _loss_of(output: Any) -> torch.Tensor | None:
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
    raise ConfigurationError(
        f"training_step returned {type(output).__name__}; return the loss tensor, a dict with "
        "a 'loss' key, or None to skip the step."
    )


def _configure_optimizers(
    model: Module,
) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]]]:
    """Normalise every form ``configure_optimizers`` may return."""
    config = model.configure_optimizers()
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[dict[str, Any]] = []

    def add_scheduler(item: Any) -> None:
        entry = dict(item) if isinstance(item, Mapping) else {"scheduler": item}
        if "scheduler" not in entry:
            raise ConfigurationError("An lr_scheduler dict needs a 'scheduler' key.")
        entry.setdefault("interval", "epoch")
        entry.setdefault("frequency", 1)
        if entry["interval"] not in ("epoch", "step"):
            raise ConfigurationError(
                f"lr_scheduler interval {entry['interval']!r}: use 'epoch' or 'step'."
            )
        schedulers.append(entry)

    def add(item: Any) -> None:
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, Mapping) and "optimizer" in item:
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                add_scheduler(item["lr_scheduler"])
        else:
            raise ConfigurationError(
                f"configure_optimizers() returned {type(item).__name__}. Return an optimizer, "
                "a list of them, (optimizers, schedulers), or {'optimizer': ..., "
                "'lr_scheduler': ...}."
            )

    if (
        isinstance(config, tuple | list)
        and len(config) == 2
        and isinstance(config[0], list | tuple)
        and isinstance(config[1], list | tuple)
    ):
        for item in config[0]:
            add(item)
        for item in config[1]:
            add_scheduler(item)
    elif isinstance(config, list | tuple):
        for item in config:
            add(item)
    else:
        add(config)
    if not optimizers:
        raise ConfigurationError("configure_optimizers() returned no optimizer.")
    return optimizers, schedulers
