"""`ModelCheckpoint`: keep the best ``k`` checkpoints by a metric, and the last one."""

from __future__ import annotations

import math
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["ModelCheckpoint"]

_FIELD = re.compile(r"\{([A-Za-z_][\w/]*)(?::[^}]*)?\}")


class ModelCheckpoint(Callback):
    """Save checkpoints during fit: the top ``save_top_k`` by ``monitor``, and ``last.ckpt``.

    When to save is one trigger: every ``every_n_epochs`` epochs (the default, 1), every
    ``every_n_train_steps`` optimizer steps, or once ``train_time_interval`` has passed
    (checked after each optimizer step). Step and time saves come right after the
    optimizer step, mid-epoch included; the time is rank 0's clock, and every rank gets
    its decision through ``strategy.reduce_boolean_decision``, so all ranks save together.

    Which checkpoints to keep is decided on rank zero's metric value, broadcast through the
    strategy, so every rank agrees on which files exist and all take part in sharded saves.
    Nothing is lost to a crash: the new checkpoint is written completely (each strategy
    writes it under a temporary name and renames it), then ``last.ckpt`` and the top-k
    bookkeeping switch to it, and only then is the checkpoint it replaces deleted. What a
    killed save left behind (the hidden ``.<name>.ckpt*.tmp`` staging files and
    directories) is removed by rank 0 after the next save.

    Args:
        dirpath: where to write (default: ``<default_root_dir>/checkpoints``).
        filename: a format string over ``epoch``, ``step`` and logged metrics (default
            ``"epoch={epoch}-step={step}"``).
        monitor: the metric to rank by; None keeps the latest ``save_top_k``.
        mode: ``"min"`` or ``"max"``.
        save_top_k: how many to keep (``-1``: all; ``0``: none but ``last``).
        save_last: also write ``last.ckpt`` at every save.
        every_n_epochs: save every this many epochs (``0``: never at an epoch's end). The
            default is 1 unless another trigger is given.
        every_n_train_steps: save every this many optimizer steps (``global_step``).
        train_time_interval: save when this much time has passed since the fit started or
            the last such save.
        save_on_train_epoch_end: save at the end of the training epoch instead of after
            validation (default, as in Lightning: at the epoch's end, unless validation
            runs more than once an epoch or not every epoch).

    Raises:
        ConfigurationError: a negative count, a non-positive interval, or more than one
            of ``every_n_epochs``, ``every_n_train_steps`` and ``train_time_interval``.
    """

    FILE_EXTENSION = ".ckpt"
    LAST_NAME = "last"

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = False,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigurationError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_top_k < -1:
            raise ConfigurationError(f"ModelCheckpoint(save_top_k={save_top_k}) must be >= -1.")
        for name, value in (
            ("every_n_epochs", every_n_epochs),
            ("every_n_train_steps", every_n_train_steps),
        ):
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ConfigurationError(
                    f"ModelCheckpoint({name}={value!r}) must be an int >= 0 (0: off)."
                )
        if train_time_interval is not None and (
            not isinstance(train_time_interval, timedelta)
            or train_time_interval.total_seconds() <= 0
        ):
            raise ConfigurationError(
                f"ModelCheckpoint(train_time_interval={train_time_interval!r}) must be a "
                "positive datetime.timedelta, e.g. timedelta(minutes=30)."
            )
        triggers = [
            name
            for name, on in (
                ("every_n_epochs", bool(every_n_epochs)),
                ("every_n_train_steps", bool(every_n_train_steps)),
                ("train_time_interval", train_time_interval is not None),
            )
            if on
        ]
        if len(triggers) > 1:
            raise ConfigurationError(
                f"ModelCheckpoint: {' and '.join(triggers)} were both given; pick one trigger "
                "(use two ModelCheckpoint callbacks to save on both)."
            )
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        if every_n_epochs is None:
            every_n_epochs = 0 if triggers else 1
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._step_seen = -1
        self._last_time = 0.0

    @property
    @override
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    @override
    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

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

    def _maybe_save_epoch(self, trainer: Trainer) -> None:
        if (
            not self.every_n_epochs
            or (trainer.current_epoch + 1) % self.every_n_epochs
            or trainer.global_step == self._last_saved_step
        ):
            return
        self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        """Write the new checkpoint(s), switch to them, then delete what they replace."""
        self._last_saved_step = trainer.global_step
        score: float | None = None
        if self.monitor is not None:
            metric = trainer.callback_metrics.get(self.monitor)
            if metric is None:
                raise ConfigurationError(
                    f"ModelCheckpoint monitors {self.monitor!r}, which was not logged. Logged "
                    f"metrics: {sorted(trainer.callback_metrics)}."
                )
            # Rank zero's value decides, so every rank keeps the same set of files.
            score = float(trainer.strategy.broadcast(float(metric), src=0))
        replaced = self._save_top_k(trainer, score) if self.save_top_k != 0 else None
        if self.save_last:
            last = self._dir() / f"{self.LAST_NAME}{self.FILE_EXTENSION}"
            previous_last, self.last_model_path = self.last_model_path, str(last)
            try:
                trainer.save_checkpoint(last)
            except BaseException:
                self.last_model_path = previous_last
                raise
        if replaced is not None:
            trainer.strategy.remove_checkpoint(replaced)
        if trainer.is_global_zero:
            self._remove_leftovers()

    def _dir(self) -> Path:
        assert self.dirpath is not None
        return self.dirpath

    def _format(self, trainer: Trainer) -> str:
        values: dict[str, Any] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        names = {match.group(1) for match in _FIELD.finditer(self.filename)}
        missing = sorted(names - set(values))
        if missing:
            raise ConfigurationError(
                f"ModelCheckpoint(filename={self.filename!r}) uses {missing}, which are not "
                f"logged. Available: {sorted(values)}."
            )
        return self.filename.format(**values)

    def _save_top_k(self, trainer: Trainer, score: float | None) -> str | None:
        """Save into the top k if the new checkpoint belongs there; return the one it replaces.

        The bookkeeping changes before the write, so the checkpoint holds it as it will
        be, and is put back if the write fails; the replaced file is deleted by the caller
        once everything new is written.
        """
        path = str(self._dir() / f"{self._format(trainer)}{self.FILE_EXTENSION}")
        if score is None:
            ranking = float(trainer.global_step)  # newest first when nothing is monitored
        else:
            if math.isnan(score):
                score = math.inf if self.mode == "min" else -math.inf
            ranking = score if self.mode == "max" else -score
        worst: str | None = None
        if self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k:
            worst = min(self.best_k_models, key=self.best_k_models.__getitem__)
            if not ranking > self.best_k_models[worst]:
                return None
        before = (dict(self.best_k_models), self.best_model_path, self.best_model_score)
        if worst is not None:
            del self.best_k_models[worst]
        self.best_k_models[path] = ranking
        best = max(self.best_k_models, key=self.best_k_models.__getitem__)
        self.best_model_path = best
        if score is not None:
            top = self.best_k_models[best]
            self.best_model_score = top if self.mode == "max" else -top
        try:
            trainer.save_checkpoint(path)
        except BaseException:
            self.best_k_models, self.best_model_path, self.best_model_score = before
            raise
        return worst if worst is not None and worst != path else None

    def _remove_leftovers(self) -> None:
        """Delete the staging files and directories a killed save left in ``dirpath``.

        Only hidden names derived from a checkpoint name: ``.<name>.tmp`` and
        ``.<name>.<random>.tmp`` (staged, never switched in), and ``.<name>.old`` once
        ``<name>`` exists again. Finished checkpoints are never touched.
        """
        directory = self._dir()
        if not directory.is_dir():
            return
        ext = re.escape(self.FILE_EXTENSION)
        staged = re.compile(rf"\.(?P<name>.+{ext})\.(?:\w+\.)?tmp")
        moved_aside = re.compile(rf"\.(?P<name>.+{ext})\.old")
        for entry in directory.iterdir():
            if staged.fullmatch(entry.name) or (
                (match := moved_aside.fullmatch(entry.name))
                and (directory / match.group("name")).exists()
            ):
                _remove(entry)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "dirpath": str(self.dirpath) if self.dirpath is not None else None,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")


def _remove(path: Path) -> None:
    """Delete a file or a directory tree; one that is already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
