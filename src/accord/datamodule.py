"""`DataModule`: the data of a run in one object, with Lightning's ``LightningDataModule`` hooks.

A run given ``datamodule=`` calls, on every rank: `DataModule.prepare_data` on local rank
zero only (global rank zero with ``prepare_data_per_node = False``), a barrier through
the strategy so no rank reads before the files are there, `DataModule.setup` with the
stage, the stage's loaders, and `DataModule.teardown` at the end.
`DataModule.state_dict` and the hyperparameters `DataModule.save_hyperparameters`
recorded are saved in the Trainer's checkpoints (under ``"datamodule"`` and
``"datamodule_hyper_parameters"``); the state comes back to `DataModule.load_state_dict`
when a fit resumes, and `DataModule.load_from_checkpoint` builds the datamodule again.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from typing_extensions import Self

from accord import hparams as _hp
from accord.checkpoint.reading import read_checkpoint
from accord.core.buffers import move_to_device
from accord.errors import ConfigurationError
from accord.hparams import HyperparametersMixin

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "DataModule",
    "check_datamodule",
    "warn_unused_val_loader",
]

"""``(batch, device, dataloader_idx) -> batch`` on the device."""

_TRANSFER_HOOKS = (
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)


class DataModule(HyperparametersMixin):
    """Base class for a run's data; override the hooks you need.

    ``self.trainer`` is the Trainer running it (None outside a run).

    Attributes:
        name: a name for the datamodule (None unless a subclass sets one), as in Lightning.
        prepare_data_per_node: `prepare_data` runs on local rank zero of every node
            (True, the default) or on global rank zero only (False, for data on a
            filesystem every node shares).
    """

    name: str | None = None
    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"
    """Where the Trainer's checkpoints hold `hparams` (Lightning's key)."""
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"
    """Lightning's key for the name of a single ``hparams`` argument (accord writes none)."""
    CHECKPOINT_HYPER_PARAMS_TYPE = "datamodule_hparams_type"
    """Lightning's key for the type of ``hparams`` (accord writes none: it is a dict)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.prepare_data_per_node = True

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        *,
        map_location: str | torch.device | None = None,
        hparams_file: str | Path | None = None,
        weights_only: bool = True,
        **overrides: Any,
    ) -> Self:
        """Build the datamodule from a checkpoint the Trainer wrote, as Lightning does.

        ``cls(**hyperparameters, **overrides)`` is built with what `save_hyperparameters`
        recorded (``"datamodule_hyper_parameters"``; ``overrides`` replace or add
        arguments), then the checkpoint's datamodule state, if any, is given to
        `load_state_dict`. The file is read with ``weights_only=True`` unless you pass
        False for a checkpoint you trust.

        Args:
            checkpoint_path: a checkpoint file or directory the Trainer wrote.
            map_location: accepted for Lightning's signature; a datamodule holds no weights.
            hparams_file: not supported (refused): pass the values as ``overrides``.
            weights_only: as in `torch.load`; False runs the pickled objects' code.
            overrides: ``__init__`` arguments to use instead of (or besides) the saved ones.

        Raises:
            CheckpointError: nothing readable at the path, or ``cls`` does not take the
                saved arguments.
            ConfigurationError: ``hparams_file`` was given.
        """
        if hparams_file is not None:
            raise ConfigurationError(
                f"{cls.__name__}.load_from_checkpoint(hparams_file=...) is not supported: "
                "the checkpoint holds the hyperparameters; pass any others as keyword "
                "arguments (load_from_checkpoint(path, batch_size=32))."
            )
        checkpoint = read_checkpoint(checkpoint_path, weights_only=weights_only)
        datamodule = _hp.build_from_hparams(
            cls, checkpoint, cls.CHECKPOINT_HYPER_PARAMS_KEY, checkpoint_path, overrides
        )
        if checkpoint.get("datamodule"):
            datamodule.load_state_dict(checkpoint["datamodule"])
        return datamodule

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Dataset[Any] | Any | None = None,
        val_dataset: Dataset[Any] | Any | None = None,
        test_dataset: Dataset[Any] | Any | None = None,
        predict_dataset: Dataset[Any] | Any | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> Self:
        """A datamodule whose loaders are plain `DataLoader` objects over the datasets given.

        As in Lightning: the training loader shuffles (unless its dataset is an
        `IterableDataset`), the others do not; a collection of datasets gives the same
        collection of loaders. ``batch_size`` and ``num_workers`` are passed to ``cls``
        too when its ``__init__`` takes them (or ``**kwargs``), with ``datamodule_kwargs``.

        Args:
            train_dataset: the dataset(s) of `train_dataloader`.
            val_dataset: the dataset(s) of `val_dataloader`.
            test_dataset: the dataset(s) of `test_dataloader`.
            predict_dataset: the dataset(s) of `predict_dataloader`.
            batch_size: every loader's batch size.
            num_workers: every loader's worker processes.
            datamodule_kwargs: other ``__init__`` arguments of ``cls``.
        """
        parameters = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        extra = {
            name: value
            for name, value in (("batch_size", batch_size), ("num_workers", num_workers))
            if takes_any or name in parameters
        }
        datamodule = cls(**datamodule_kwargs, **extra)
        for hook, datasets, shuffle in (
            ("train_dataloader", train_dataset, True),
            ("val_dataloader", val_dataset, False),
            ("test_dataloader", test_dataset, False),
            ("predict_dataloader", predict_dataset, False),
        ):
            if datasets is not None:
                loaders = _Loaders(datasets, shuffle, batch_size, num_workers)
                setattr(datamodule, hook, loaders)
        return datamodule

    # -------------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Download or write data; called on local rank zero of each node only (global
        rank zero with ``prepare_data_per_node = False``).

        Do not set state here: other ranks never run it. Use `setup` for that.
        """

    def setup(self, stage: str) -> None:
        """Build datasets; called on every rank with ``"fit"``, ``"validate"``, ``"test"``
        or ``"predict"``, after `prepare_data` finished on every node."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` made; called on every rank at the end of a run."""

    def train_dataloader(self) -> Any:
        """The training loader (needed by ``fit``)."""
        raise ConfigurationError(
            f"{type(self).__name__} has no train_dataloader(); define it to fit with this "
            "DataModule, or pass train_dataloaders= instead."
        )

    def val_dataloader(self) -> Any:
        """The validation loader (None: no validation)."""
        return None

    def test_dataloader(self) -> Any:
        """The test loader (needed by ``test``)."""
        raise ConfigurationError(
            f"{type(self).__name__} has no test_dataloader(); define it to test with this "
            "DataModule, or pass dataloaders= instead."
        )

    def predict_dataloader(self) -> Any:
        """The predict loader (needed by ``predict``)."""
        raise ConfigurationError(
            f"{type(self).__name__} has no predict_dataloader(); define it to predict with "
            "this DataModule, or pass dataloaders= instead."
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it moves to the device (default: as it is)."""
        return batch

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Move a batch to ``device`` (default: every tensor in it, containers kept)."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch once it is on the device (default: as it is)."""
        return batch

    def on_exception(self, exception: BaseException) -> None:
        """Called when a run fails with ``exception``; clean up here (default: nothing)."""

    def state_dict(self) -> dict[str, Any]:
        """State to store in the Trainer's checkpoints (tensors and plain containers)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, when a fit resumes from a checkpoint."""


class _Loaders:
    """A ``*_dataloader`` method that `DataModule.from_datasets` gives a datamodule
    (picklable, for launchers that start processes)."""

    def __init__(self, datasets: Any, shuffle: bool, batch_size: int, num_workers: int) -> None:
        self.datasets = datasets
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.num_workers = num_workers

    def __call__(self) -> Any:
        return apply_to_collection(self.datasets, Dataset, self._loader)

    def _loader(self, dataset: Dataset[Any]) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle and not isinstance(dataset, IterableDataset),
            num_workers=self.num_workers,
        )


def check_datamodule(
    stage: str, loader: Any, other_loader: Any, datamodule: DataModule | None
) -> DataModule | None:
    """``datamodule`` when it is the only source of data given to ``stage``.

    Raises:
        ConfigurationError: loaders and a datamodule were both given, or ``datamodule``
            is not a `DataModule`.
    """
    if datamodule is None:
        return None
    if not isinstance(datamodule, DataModule):
        raise ConfigurationError(
            f"datamodule= must be an accord.DataModule, got {type(datamodule).__name__}. "
            "Subclass accord.DataModule (a LightningDataModule ports by changing its base class)."
        )
    if loader is not None or other_loader is not None:
        raise ConfigurationError(
            f"Trainer.{stage}() got both dataloaders and a datamodule; pass one of them. "
            "The datamodule's *_dataloader() methods give the loaders."
        )
    return datamodule


def warn_unused_val_loader(model: Any) -> None:
    """Say that a validation loader goes unused because ``model`` has no ``validation_step``."""
    rank_zero_warn(
        f"A validation loader was given, but {type(model).__name__} does not define "
        "validation_step(), so no validation runs. Define validation_step(batch, batch_idx), "
        "or drop the validation loader.",
        category=UserWarning,
    )
