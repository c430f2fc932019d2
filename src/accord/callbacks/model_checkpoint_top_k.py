"""`TopKRecord`: which checkpoints `ModelCheckpoint` keeps, and the record of them it saves.

The top ``save_top_k`` by the monitored metric (without ``monitor``: the latest), the best
of them, the one the next better checkpoint replaces; how a new checkpoint enters and what
it drops; the record as the callback's state and as YAML. Where the files are written and
removed is `ModelCheckpoint`'s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.callbacks import model_checkpoint_files as files
from accord.errors import ConfigurationError

__all__ = ["TopKRecord"]

_Record = tuple[
    dict[str, torch.Tensor], str, torch.Tensor | None, str, torch.Tensor, torch.Tensor | None
]
"""A copy of the record, to put back when a save fails."""


class TopKRecord:
    """The top-k bookkeeping `ModelCheckpoint` inherits, under Lightning's attribute names.

    ``best_k_models`` maps each kept checkpoint's path to its score (without ``monitor``:
    the global step it was saved at, so the oldest leaves first); ``best_model_path`` and
    ``best_model_score`` name the best of them, ``kth_best_model_path`` and ``kth_value``
    the worst once ``k`` are kept, and ``current_score`` is the latest score.
    """

    monitor: str | None
    mode: str
    save_top_k: int
    dirpath: Path | None
    last_model_path: str

    def _reset_top_k(self) -> None:
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if self.mode == "min" else -math.inf)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None

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

    def _enter_top_k(
        self, path: str, score: float | None, step: int
    ) -> tuple[str | None, float | None]:
        """Record ``path`` with ``score`` (None: ranked by ``step``, the latest kept); return
        the checkpoint it drops, if any, and the score it was ranked by (a NaN ranks last)."""
        dropped = self._dropped_by_next()
        if dropped is not None:
            del self.best_k_models[dropped]
        self.best_k_models.pop(path, None)
        if score is None:
            self.best_k_models[path] = torch.tensor(float(step))
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
        return dropped, score

    def _top_k_record(self) -> _Record:
        return (
            dict(self.best_k_models),
            self.best_model_path,
            self.best_model_score,
            self.kth_best_model_path,
            self.kth_value,
            self.current_score,
        )

    def _restore_top_k(self, record: _Record) -> None:
        (
            self.best_k_models,
            self.best_model_path,
            self.best_model_score,
            self.kth_best_model_path,
            self.kth_value,
            self.current_score,
        ) = record

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
    def state_dict(self) -> dict[str, Any]:
        """The record, with ``monitor``, ``dirpath`` and ``last_model_path``, under
        Lightning's keys."""
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
