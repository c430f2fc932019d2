"""`ModelCheckpoint`: keep the best ``k`` checkpoints by a metric, and the last one."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import override

from accord.callbacks import model_checkpoint_files as files
from accord.callbacks.checkpoint import Checkpoint
from accord.callbacks.model_checkpoint_top_k import TopKRecord
from accord.checkpoint.writing import link_atomically, remove_leftovers
from accord.errors import ConfigurationError
from accord.log import rank_zero_info

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = ["ModelCheckpoint"]

_Plan = tuple[float | None, str | None, str | None]
"""Rank zero's score and the paths of the top-k and the last checkpoint it will write."""


class ModelCheckpoint(files.CheckpointNames, TopKRecord, Checkpoint):
    """Save checkpoints during fit: the top ``save_top_k`` by ``monitor``, and ``last.ckpt``.

    Lightning's arguments, names and directory. Without ``dirpath`` the checkpoints go
    beside the first logger's files, in ``<save_dir>/<name>/version_<n>/checkpoints``
    (``<default_root_dir>/checkpoints`` without a logger); rank zero resolves it and
    every rank uses rank zero's (another rank may number log versions apart). The file
    name is ``filename`` formatted with ``epoch``, ``step`` and the logged metrics, each
    field written as ``name=value`` (``auto_insert_metric_name``): ``"{epoch}-{val_loss:.4f}"``
    gives ``epoch=5-val_loss=0.1084.ckpt``, the default ``epoch=0-step=4.ckpt``. A metric
    name with a ``/`` (``val/loss``) puts the file in a sub-directory, as in Lightning; pass
    ``auto_insert_metric_name=False`` and write the name yourself to avoid that. A name
    already taken on disk gets ``-v1``, ``-v2``, ... (``enable_version_counter``).

    When to save is one trigger: every ``every_n_epochs`` epochs (the default, 1), every
    ``every_n_train_steps`` optimizer steps, or once ``train_time_interval`` has passed
    (checked after each optimizer step). Step and time saves come right after the
    optimizer step, mid-epoch included; the time is rank 0's clock, and every rank gets
    its decision through ``strategy.reduce_boolean_decision``, so all ranks save together.
    ``last.ckpt`` is written at every save (Lightning 2.6 skips it when no top-k file was
    written), and at the end of a fit that saved nothing.

    Which checkpoints to keep, and their names, are decided on rank zero (its metric
    value, the names free on its disk) and broadcast through the strategy, so every rank
    agrees on which files exist and all take part in sharded saves. Nothing is lost to a
    crash: the new checkpoint is written completely (each strategy writes it under a
    temporary name and renames it), then ``last.ckpt`` and the top-k bookkeeping switch to
    it, and only then is the checkpoint it replaces deleted. What a killed save left behind
    (the hidden ``.<name>.ckpt*.tmp`` staging files and directories) is removed by rank 0
    after the next save.

    Args:
        dirpath: where to write (default: the first logger's version directory's
            ``checkpoints``, or ``<default_root_dir>/checkpoints`` without a logger).
        filename: a format string over ``epoch``, ``step`` and logged metrics (default
            ``"{epoch}-{step}"``).
        monitor: the metric to rank by; None keeps the latest ``save_top_k``.
        verbose: say on rank zero what each save did.
        save_last: also write ``last.ckpt`` at every save; ``"link"``: make it a symbolic
            link to the newest checkpoint file written (a copy where links are not
            possible), switched in atomically.
        save_top_k: how many to keep (``-1``: all; ``0``: none but ``last``).
        save_on_exception: refused (True): after an exception on one rank the others
            cannot take part in a save.
        save_weights_only: write only the weights and what ``load_from_checkpoint`` needs
            (epoch, step, hyperparameters); such a file cannot resume a fit.
        mode: ``"min"`` or ``"max"``.
        auto_insert_metric_name: write each field of ``filename`` as ``name=value``.
        every_n_train_steps: save every this many optimizer steps (``global_step``).
        train_time_interval: save when this much time has passed since the fit started or
            the last such save.
        every_n_epochs: save every this many epochs (``0``: never at an epoch's end). The
            default is 1 unless another trigger is given.
        save_on_train_epoch_end: save at the end of the training epoch instead of after
            validation (default, as in Lightning: at the epoch's end, unless validation
            runs more than once an epoch or not every epoch).
        enable_version_counter: give a name already on disk a ``-v<n>`` suffix instead of
            overwriting it.

    Raises:
        ConfigurationError: a negative count, a non-positive interval, more than one of
            ``every_n_epochs``, ``every_n_train_steps`` and ``train_time_interval``, an
            unknown ``mode`` or ``save_last``, or ``save_on_exception=True``.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
    ) -> None:
        triggers = files.check_arguments(
            mode, save_top_k, save_last, save_on_exception, every_n_epochs,
            every_n_train_steps, train_time_interval,
        )  # fmt: skip
        self._given_dirpath = Path(dirpath).expanduser().resolve() if dirpath is not None else None
        self.dirpath: Path | None = self._given_dirpath
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_on_exception = save_on_exception
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        if every_n_epochs is None:
            every_n_epochs = 0 if triggers else 1
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self._reset_top_k()
        self.last_model_path = ""
        self._last_checkpoint_saved = ""
        self._last_saved_step = -1
        self._step_seen = -1
        self._last_time = 0.0

    @property
    @override
    def state_key(self) -> str:
        """Lightning's key: the class with the arguments that tell two callbacks apart."""
        arguments = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self.every_n_train_steps,
            "every_n_epochs": self.every_n_epochs,
            "train_time_interval": self.train_time_interval,
        }
        return f"{type(self).__qualname__}{arguments!r}"

    # ------------------------------------------------------------------ where
    @override
    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        # Rank zero's directory for every rank: log versions may be numbered apart.
        dirpath = self._resolve_dirpath(trainer) if trainer.is_global_zero else None
        resolved = trainer.strategy.broadcast(dirpath, src=0)
        assert resolved is not None
        self.dirpath = Path(resolved)

    # ------------------------------------------------------------------- when
    @override
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        self._step_seen = trainer.global_step
        self._last_time = time.monotonic()

    def _on_train_end_of_epoch(self, trainer: Trainer) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        # Lightning's rule: at the epoch's end, unless validation runs more than once an
        # epoch or not every epoch (then after validation).
        if trainer.check_val_every_n_epoch != 1:
            return False
        return not trainer.has_validation or trainer.val_check_interval in (None, 1.0)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        if not stepped or trainer.global_step == self._last_saved_step:
            return  # mid-accumulation, or this step is saved already
        due = bool(self.every_n_train_steps) and trainer.global_step % self.every_n_train_steps == 0
        if self.train_time_interval is not None:
            now = time.monotonic()
            late = now - self._last_time >= self.train_time_interval.total_seconds()
            # Rank 0's clock decides; every rank gets the same answer.
            if trainer.strategy.reduce_boolean_decision(trainer.is_global_zero and late, all=False):
                self._last_time = now
                due = True
        if due:
            self._save(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if (
            trainer.stage == "fit"
            and not trainer.sanity_checking
            and not self._on_train_end_of_epoch(trainer)
        ):
            self._maybe_save_epoch(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._on_train_end_of_epoch(trainer):
            self._maybe_save_epoch(trainer)

    @override
    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        # As in Lightning: a fit whose triggers never fired still leaves last.ckpt.
        if self.save_last and not self._last_checkpoint_saved:
            self._save(trainer, top_k=False)

    def _maybe_save_epoch(self, trainer: Trainer) -> None:
        if (
            not self.every_n_epochs
            or (trainer.current_epoch + 1) % self.every_n_epochs
            or trainer.global_step == self._last_saved_step
        ):
            return
        self._save(trainer)

    # ------------------------------------------------------------------- save
    def _save(self, trainer: Trainer, top_k: bool = True) -> None:
        """Write the new checkpoint(s), switch to them, then delete what they replace."""
        self._last_saved_step = trainer.global_step
        values = self._monitor_candidates(trainer)
        top_k = top_k and self.save_top_k != 0
        score: float | None = None
        if self.monitor is not None and top_k:
            metric = values.get(self.monitor)
            if metric is None:
                raise ConfigurationError(
                    f"ModelCheckpoint monitors {self.monitor!r}, which was not logged. Logged "
                    f"metrics: {sorted(trainer.callback_metrics)}."
                )
            score = float(metric)
        if top_k:
            self._check_name(self.filename, values)
        if self.save_last:
            self._check_name(self.CHECKPOINT_NAME_LAST, values)
        plan = self._plan(values, score, top_k) if trainer.is_global_zero else (None, None, None)
        score, top_path, last_path = trainer.strategy.broadcast(plan, src=0)
        replaced = None
        if top_path is not None:
            replaced = self._save_top_k(trainer, top_path, score, values)
        elif top_k and self.monitor is not None and self.verbose and trainer.is_global_zero:
            rank_zero_info(
                log,
                "%s",
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: "
                f"{self.monitor!r} was not in top {self.save_top_k}",
            )
        if last_path is not None:
            self._save_last(trainer, last_path)
        if replaced is not None:
            self._remove(trainer, replaced)
        if trainer.is_global_zero and self.dirpath is not None and self.dirpath.is_dir():
            remove_leftovers(self.dirpath, self.FILE_EXTENSION, self._name_depth())

    def _plan(self, values: Mapping[str, Any], score: float | None, top_k: bool) -> _Plan:
        """Rank zero's decision: whether the new checkpoint enters the top k, and the free
        names of it and of the last checkpoint."""
        top_path = None
        if top_k and self._enters_top_k(score):
            reusable = {self._dropped_by_next() or ""}
            if self.monitor is None:
                reusable.add(self.best_model_path)
            top_path = self._free_name(values, self.filename, reusable)
        last_path = None
        if self.save_last:
            last_path = self._free_name(values, self.CHECKPOINT_NAME_LAST, {self.last_model_path})
        return score, top_path, last_path

    def _save_top_k(
        self, trainer: Trainer, path: str, score: float | None, values: Mapping[str, Any]
    ) -> str | None:
        """Save ``path`` into the top k; return the checkpoint it replaces.

        The bookkeeping changes before the write, so the checkpoint holds it as it will
        be, and is put back if the write fails; the replaced file is deleted by the caller
        once everything new is written.
        """
        before = self._top_k_record()
        dropped, score = self._enter_top_k(path, score, trainer.global_step)
        try:
            self._write(trainer, path)
        except BaseException:
            self._restore_top_k(before)
            raise
        if self.verbose and score is not None and trainer.is_global_zero:
            best = float(self.best_model_score) if self.best_model_score is not None else score
            rank_zero_info(
                log,
                "%s",
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: "
                f"{self.monitor!r} reached {score:0.5f} (best {best:0.5f}), saving model to "
                f"{path!r} as top {self._k()}",
            )
        elif self.verbose and trainer.is_global_zero:
            rank_zero_info(
                log, "%s", f"Global step {trainer.global_step}: saving model to {path!r}"
            )
        return dropped if dropped is not None and dropped != path else None

    def _save_last(self, trainer: Trainer, path: str) -> None:
        previous, self.last_model_path = self.last_model_path, path
        try:
            target = self._last_checkpoint_saved
            if self.save_last == "link" and target and self.save_top_k != 0:
                self._link(trainer, target, path)
            else:
                self._write(trainer, path)
        except BaseException:
            self.last_model_path = previous
            raise
        if previous and previous != path:
            self._remove(trainer, previous)

    def _write(self, trainer: Trainer, path: str) -> None:
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        self._last_checkpoint_saved = path
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _link(self, trainer: Trainer, target: str, path: str) -> None:
        with trainer.strategy.agree_on_save(path):
            if trainer.is_global_zero and Path(target).absolute() != Path(path).absolute():
                link_atomically(Path(target), Path(path))

    def _remove(self, trainer: Trainer, path: str) -> None:
        """Delete a checkpoint this callback replaced (never one outside ``dirpath``)."""
        directory = self.dirpath
        if directory is None or directory not in Path(path).absolute().parents:
            return
        trainer.strategy.remove_checkpoint(path)
        if trainer.is_global_zero:
            files.remove_empty_parents(Path(path), directory)
