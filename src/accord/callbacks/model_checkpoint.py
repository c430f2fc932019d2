"""`ModelCheckpoint`: keep the best ``k`` checkpoints by a metric, and the last one."""

from __future__ import annotations

import math
import re
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

    Rank zero writes (atomically); the decision to save or delete is made on rank zero's
    metric value and broadcast through the strategy, so every rank agrees on which files
    exist and all take part in sharded saves together.

    Args:
        dirpath: where to write (default: ``<default_root_dir>/checkpoints``).
        filename: a format string over ``epoch``, ``step`` and logged metrics (default
            ``"epoch={epoch}-step={step}"``).
        monitor: the metric to rank by; None keeps the latest ``save_top_k``.
        mode: ``"min"`` or ``"max"``.
        save_top_k: how many to keep (``-1``: all; ``0``: none but ``last``).
        save_last: also write ``last.ckpt`` at every save.
        every_n_epochs: save every this many epochs.
        save_on_train_epoch_end: save at the end of the training epoch instead of after
            validation (default: after validation when there is any).
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
        every_n_epochs: int = 1,
        save_on_train_epoch_end: bool | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigurationError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_top_k < -1:
            raise ConfigurationError(f"ModelCheckpoint(save_top_k={save_top_k}) must be >= -1.")
        if every_n_epochs < 1:
            raise ConfigurationError(f"every_n_epochs={every_n_epochs} must be >= 1.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_epochs = every_n_epochs
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1

    @property
    @override
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    @override
    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def _on_train_end_of_epoch(self, trainer: Trainer) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        return not trainer.has_validation

    @override
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.stage == "fit" and not self._on_train_end_of_epoch(trainer):
            self._maybe_save(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._on_train_end_of_epoch(trainer):
            self._maybe_save(trainer)

    def _maybe_save(self, trainer: Trainer) -> None:
        if (
            trainer.current_epoch + 1
        ) % self.every_n_epochs or trainer.global_step == self._last_saved_step:
            return
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
        if self.save_top_k != 0:
            self._save_top_k(trainer, score)
        if self.save_last:
            last = self._dir() / f"{self.LAST_NAME}{self.FILE_EXTENSION}"
            trainer.save_checkpoint(last)
            self.last_model_path = str(last)

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

    def _save_top_k(self, trainer: Trainer, score: float | None) -> None:
        path = self._dir() / f"{self._format(trainer)}{self.FILE_EXTENSION}"
        if score is None:
            ranking = float(trainer.global_step)  # newest first when nothing is monitored
            better = True
        else:
            if math.isnan(score):
                score = math.inf if self.mode == "min" else -math.inf
            ranking = score if self.mode == "max" else -score
            better = True
        if self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k:
            worst = min(self.best_k_models, key=self.best_k_models.__getitem__)
            better = ranking > self.best_k_models[worst]
            if not better:
                return
            del self.best_k_models[worst]
            if worst != str(path):
                trainer.strategy.remove_checkpoint(worst)
        trainer.save_checkpoint(path)
        self.best_k_models[str(path)] = ranking
        best = max(self.best_k_models, key=self.best_k_models.__getitem__)
        self.best_model_path = best
        if score is not None:
            top = self.best_k_models[best]
            self.best_model_score = top if self.mode == "max" else -top

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
