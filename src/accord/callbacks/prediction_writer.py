"""`BasePredictionWriter`: write predictions per batch, per epoch, or both."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)
from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["BasePredictionWriter", "WriteInterval"]


class WriteInterval(str, Enum):
    """When a `BasePredictionWriter` writes."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        """Whether it writes after each batch."""
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        """Whether it writes once all batches are predicted."""
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Base class of a callback that writes what ``predict_step`` returns; subclass it
    and override `write_on_batch_end`, `write_on_epoch_end` or both, as in Lightning.

    Under several ranks each rank predicts its own share of the samples and writes its
    own predictions (name the files after ``trainer.global_rank``); ``batch_indices``
    says which samples of the dataset each prediction is for.

    ``batch_indices`` are known for a `DataLoader` over a map-style dataset whose order
    is fixed: in order (``shuffle=False``), the shard accord gives each rank, or a
    `DistributedSampler`; accord reads them from the loader's sampler when predict
    starts, without loading any data. For another loader (an iterable dataset, a
    shuffled one, a custom batch sampler) accord warns once and passes empty lists, as
    Lightning does for a loader it cannot read them from.

    Args:
        write_interval: ``"batch"`` (call `write_on_batch_end` after each batch),
            ``"epoch"`` (call `write_on_epoch_end` once, with every prediction of this
            rank) or ``"batch_and_epoch"``.

    Raises:
        ConfigurationError: another ``write_interval``.
    """

    def __init__(self, write_interval: str = "batch") -> None:
        choices = [i.value for i in WriteInterval]
        if write_interval not in choices:
            raise ConfigurationError(
                f"BasePredictionWriter(write_interval={write_interval!r}): use one of {choices}."
            )
        self.interval = WriteInterval(write_interval)
        self._batch_indices: list[list[int]] | None = None
        self._predictions: list[Any] = []
        self._epoch_indices: list[list[int]] = []

    def write_on_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write the prediction of one batch (``write_interval`` ``"batch"`` or
        ``"batch_and_epoch"``).

        Args:
            trainer: the Trainer.
            module: the module predicting.
            prediction: what ``predict_step`` returned for the batch.
            batch_indices: the dataset indices of the batch's samples (empty where
                accord cannot tell them).
            batch: the batch, on the device.
            batch_idx: the batch's index on this rank.
            dataloader_idx: the loader's index (always 0: accord predicts one loader).
        """
        raise NotImplementedError(
            f"{type(self).__name__} writes per batch (write_interval="
            f"{self.interval.value!r}) but does not override write_on_batch_end()."
        )

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        module: Module,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Write every prediction of this rank at once (``write_interval`` ``"epoch"`` or
        ``"batch_and_epoch"``).

        Args:
            trainer: the Trainer.
            module: the module that predicted.
            predictions: what ``predict_step`` returned for each batch, in order, with
                its tensors moved to the CPU.
            batch_indices: as Lightning passes them, one list per loader (accord has
                one): ``batch_indices[0][i]`` holds the dataset indices of batch ``i``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} writes per epoch (write_interval="
            f"{self.interval.value!r}) but does not override write_on_epoch_end()."
        )

    @override
    def on_predict_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._predictions, self._epoch_indices = [], []
        self._batch_indices = _batch_indices(trainer.predict_dataloaders)
        if self._batch_indices is None:
            rank_zero_warn(
                f"{type(self).__name__}: accord cannot tell which samples each predict "
                "batch holds for this loader (an iterable dataset, a shuffled or custom "
                "sampler), so batch_indices are empty lists.",
                category=UserWarning,
            )

    @override
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        known = self._batch_indices
        indices = known[batch_idx] if known is not None and batch_idx < len(known) else []
        if self.interval.on_epoch:
            self._predictions.append(apply_to_collection(outputs, torch.Tensor, torch.Tensor.cpu))
            self._epoch_indices.append(indices)
        if self.interval.on_batch:
            self.write_on_batch_end(
                trainer, module, outputs, indices, batch, batch_idx, dataloader_idx
            )

    @override
    def on_predict_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self.interval.on_epoch:
            self.write_on_epoch_end(trainer, module, self._predictions, [self._epoch_indices])
        self._predictions, self._epoch_indices = [], []


def _batch_indices(loader: Iterable[Any] | None) -> list[list[int]] | None:
    """The dataset indices of each batch ``loader`` will yield, where its order is fixed
    and can be read from its sampler without drawing random numbers; else None."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: every sample is its own batch
        return [[int(i)] for i in loader.sampler] if _fixed(loader.sampler) else None
    if type(batch_sampler) is not BatchSampler or not _fixed(batch_sampler.sampler):
        return None
    return [[int(i) for i in batch] for batch in batch_sampler]


def _fixed(sampler: Any) -> bool:
    """Whether iterating ``sampler`` gives the order the loader uses and touches no
    random state: in order, a `DistributedSampler` (seeded by its epoch), or the shard
    accord's predict gives each rank."""
    from accord.trainer.data import _Indices

    return type(sampler) in (SequentialSampler, DistributedSampler, _Indices)
