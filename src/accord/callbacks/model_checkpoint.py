"""`ModelCheckpoint`: keep the best ``k`` checkpoints by a metric, and the last one."""

from __future__ import annotations

import logging
import math
import string
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from accord.callbacks import model_checkpoint_files as files
from accord.callbacks.checkpoint import Checkpoint
from accord.checkpoint.formats import finished_checkpoints
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


class ModelCheckpoint(Checkpoint):
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

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

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
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
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

    def _resolve_dirpath(self, trainer: Trainer) -> Path:
        if self._given_dirpath is not None:
            return self._given_dirpath
        return files.default_checkpoint_dir(trainer)

    def checkpoint_dirs(self, trainer: Trainer) -> list[Path]:
        """Where ``ckpt_path="last"`` and a restarted job look for this callback's files.

        ``dirpath`` when given. Otherwise the default directory of ``trainer``'s run and,
        when its logger numbers versions itself, the ``checkpoints`` of the experiment's
        other versions (a restarted job writes to a new version).
        """
        if self._given_dirpath is not None:
            return [self._given_dirpath]
        return files.experiment_checkpoint_dirs(trainer)

    def find_checkpoints(self, trainer: Trainer) -> list[Path]:
        """The finished checkpoints in `checkpoint_dirs` (in the sub-directories a ``/`` in
        the file name makes too); saves cut short are left out."""
        return finished_checkpoints(
            self.checkpoint_dirs(trainer), self.FILE_EXTENSION, self._name_depth()
        )

    # ------------------------------------------------------------------ names
    def format_checkpoint_name(
        self,
        metrics: Mapping[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        """The path a checkpoint with ``metrics`` gets, as in Lightning.

        ``filename`` (default: this callback's) is formatted with ``metrics``, each field
        as ``name=value`` with ``auto_insert_metric_name`` (a field not in ``metrics`` is
        0); ``prefix`` goes in front and ``-v<ver>`` behind, joined with
        `CHECKPOINT_JOIN_CHAR`; then `FILE_EXTENSION`, under ``dirpath`` once it is known.

        Example: with ``filename="{epoch}-{val_loss:.2f}"``,
        ``format_checkpoint_name({"epoch": 2, "val_loss": 0.123})`` ends in
        ``epoch=2-val_loss=0.12.ckpt``.
        """
        name = self._format_checkpoint_name(
            filename or self.filename, metrics, prefix, self.auto_insert_metric_name
        )
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        name += self.FILE_EXTENSION
        return str(self.dirpath / name) if self.dirpath is not None else name

    def _format_checkpoint_name(
        self,
        filename: str | None,
        metrics: Mapping[str, Any],
        prefix: str | None = None,
        auto_insert_metric_name: bool = True,
    ) -> str:
        template = filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        return files.format_name(
            template,
            metrics,
            prefix,
            auto_insert_metric_name,
            join=self.CHECKPOINT_JOIN_CHAR,
            equals=self.CHECKPOINT_EQUALS_CHAR,
        )

    def _check_name(self, template: str | None, values: Mapping[str, Any]) -> None:
        """Refuse a name whose fields are not all logged (Lightning would write 0), or that
        does not format; every rank checks, so a bad name stops every rank together."""
        template = template or "{epoch}{step}"
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        missing = sorted(fields - set(values))
        if missing:
            raise ConfigurationError(
                f"ModelCheckpoint(filename={template!r}) uses {missing}, which are not "
                f"logged. Available: {sorted(values)}."
            )
        try:
            self._format_checkpoint_name(template, values, None, self.auto_insert_metric_name)
        except (ValueError, TypeError) as err:
            raise ConfigurationError(
                f"ModelCheckpoint(filename={template!r}) does not format with the logged "
                f"values: {err}. Fix the format specs (a float metric takes '.4f', not 'd')."
            ) from err

    def _name_depth(self) -> int:
        """How many directories deep under ``dirpath`` the names put checkpoints."""
        depth = 0
        for template in (self.filename, self.CHECKPOINT_NAME_LAST):
            try:
                name = self._format_checkpoint_name(
                    template, {}, None, self.auto_insert_metric_name
                )
            except (ValueError, TypeError):
                continue
            depth = max(depth, name.count("/"))
        return depth

    def _free_name(
        self, values: Mapping[str, Any], template: str | None, reusable: set[str]
    ) -> str:
        """The path for ``template``: its formatted name, with the first ``-v<n>`` not on
        disk if that is taken (by a file this save does not replace)."""
        path = self.format_checkpoint_name(values, template)
        version = self.STARTING_VERSION
        while self.enable_version_counter and path not in reusable and files.taken(path):
            path = self.format_checkpoint_name(values, template, ver=version)
            version += 1
        return path

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
        """The values names are formatted with: the logged metrics, ``epoch`` and ``step``."""
        values: dict[str, Any] = dict(trainer.callback_metrics)
        epoch, step = values.get("epoch"), values.get("step")
        values["epoch"] = (
            epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
        )
        values["step"] = (
            step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
        )
        return values

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

    def _k(self) -> int:
        return len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k

    def _worst(self) -> str:
        if self.monitor is None:  # the oldest
            return min(self.best_k_models, key=lambda p: float(self.best_k_models[p]))
        pick = max if self.mode == "min" else min
        return pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))

    def _best(self) -> str:
        pick = min if self.mode == "min" else max
        return pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))

    def _dropped_by_next(self) -> str | None:
        """The checkpoint that leaves the top k when the next one enters, if any."""
        return self._worst() if len(self.best_k_models) >= self._k() > 0 else None

    def _enters_top_k(self, score: float | None) -> bool:
        if score is None or len(self.best_k_models) < self._k():
            return True
        worst = float(self.best_k_models[self._worst()])
        return score < worst if self.mode == "min" else score > worst

    def _save_top_k(
        self, trainer: Trainer, path: str, score: float | None, values: Mapping[str, Any]
    ) -> str | None:
        """Save ``path`` into the top k; return the checkpoint it replaces.

        The bookkeeping changes before the write, so the checkpoint holds it as it will
        be, and is put back if the write fails; the replaced file is deleted by the caller
        once everything new is written.
        """
        before = (
            dict(self.best_k_models),
            self.best_model_path,
            self.best_model_score,
            self.kth_best_model_path,
            self.kth_value,
            self.current_score,
        )
        dropped = self._dropped_by_next()
        if dropped is not None:
            del self.best_k_models[dropped]
        self.best_k_models.pop(path, None)
        if score is None:
            self.best_k_models[path] = torch.tensor(float(trainer.global_step))
            self.best_model_path = path
        else:
            if math.isnan(score):
                score = math.inf if self.mode == "min" else -math.inf
            self.current_score = torch.tensor(score)
            self.best_k_models[path] = self.current_score
            if len(self.best_k_models) == self._k():
                self.kth_best_model_path = self._worst()
                self.kth_value = self.best_k_models[self.kth_best_model_path]
            self.best_model_path = self._best()
            self.best_model_score = self.best_k_models[self.best_model_path]
        try:
            self._write(trainer, path)
        except BaseException:
            (
                self.best_k_models,
                self.best_model_path,
                self.best_model_score,
                self.kth_best_model_path,
                self.kth_value,
                self.current_score,
            ) = before
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
        if trainer.is_global_zero and Path(target).absolute() != Path(path).absolute():
            link_atomically(Path(target), Path(path))
        trainer.strategy.barrier("model_checkpoint_link")

    def _remove(self, trainer: Trainer, path: str) -> None:
        """Delete a checkpoint this callback replaced (never one outside ``dirpath``)."""
        directory = self.dirpath
        if directory is None or directory not in Path(path).absolute().parents:
            return
        trainer.strategy.remove_checkpoint(path)
        if trainer.is_global_zero:
            files.remove_empty_parents(Path(path), directory)

    def to_yaml(self, filepath: str | Path | None = None) -> None:
        """Write `best_k_models` (checkpoint path: score) as YAML, to ``filepath`` or
        ``<dirpath>/best_k_models.yaml``."""
        if filepath is None:
            if self.dirpath is None:
                raise ConfigurationError(
                    "ModelCheckpoint.to_yaml() needs a filepath before the callback has a "
                    "dirpath (it gets one when a run starts)."
                )
            filepath = self.dirpath / "best_k_models.yaml"
        scores = {path: float(value) for path, value in self.best_k_models.items()}
        files.write_scores_yaml(scores, Path(filepath))

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": str(self.dirpath) if self.dirpath is not None else None,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict`'s values.

        As in Lightning, a state saved with another ``dirpath`` (a restarted job writes
        to a new log version) gives back only ``best_model_path``: this run's top k starts
        afresh and never deletes the other directory's files.
        """
        saved = state.get("dirpath")
        if self.dirpath is None or saved is None or Path(saved) == self.dirpath:
            if self.dirpath is None and saved is not None:
                self.dirpath = Path(saved)
            self.best_k_models = {
                path: torch.as_tensor(value)
                for path, value in state.get("best_k_models", {}).items()
            }
            self.best_model_score = _tensor_or_none(state.get("best_model_score"))
            self.current_score = _tensor_or_none(state.get("current_score"))
            self.kth_best_model_path = state.get("kth_best_model_path", "")
            self.kth_value = torch.as_tensor(state.get("kth_value", self.kth_value))
            self.last_model_path = state.get("last_model_path", "")
        else:
            rank_zero_warn(
                f"ModelCheckpoint: the checkpoint's dirpath {saved!r} is not this run's "
                f"{str(self.dirpath)!r}, so only best_model_path is restored; the top "
                "k of this run starts afresh in its own directory.",
                category=UserWarning,
            )
        self.best_model_path = state.get("best_model_path", "")


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value)
