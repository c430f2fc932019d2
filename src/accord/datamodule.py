"""`DataModule`: the data of a run in one object, with Lightning's ``LightningDataModule`` hooks.

A run given ``datamodule=`` calls, on every rank: `DataModule.prepare_data` on local rank
zero only (download, write files), a barrier through the strategy so no rank reads before
the files are there, `DataModule.setup` with the stage, the stage's loaders, and
`DataModule.teardown` at the end. `DataModule.state_dict` is saved in the Trainer's
checkpoints and given back to `DataModule.load_state_dict` when a fit resumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["DataModule", "check_datamodule", "datamodule_loaders", "warn_unused_val_loader"]


class DataModule:
    """Base class for a run's data; override the hooks you need.

    ``self.trainer`` is the Trainer running it (None outside a run).
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def prepare_data(self) -> None:
        """Download or write data; called on local rank zero of each node only.

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

    def state_dict(self) -> dict[str, Any]:
        """State to store in the Trainer's checkpoints (tensors and plain containers)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, when a fit resumes from a checkpoint."""


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


def datamodule_loaders(
    trainer: Trainer, model: Any, datamodule: DataModule, stage: str
) -> tuple[Any, Any]:
    """Prepare ``datamodule`` on this rank and return ``stage``'s (train, eval) loaders.

    `DataModule.prepare_data` runs on local rank zero, then every rank waits at a barrier
    through the strategy, then `DataModule.setup` runs on every rank. A validation loader
    is dropped, with a warning, when ``model`` has no ``validation_step``.
    """
    datamodule.trainer = trainer
    if trainer.local_rank == 0:
        datamodule.prepare_data()
    trainer.strategy.barrier("datamodule.prepare_data")
    datamodule.setup(stage)
    if stage != "fit":
        hook = {"validate": "val", "test": "test", "predict": "predict"}[stage]
        loader = getattr(datamodule, f"{hook}_dataloader")()
        if loader is None:
            raise ConfigurationError(
                f"{type(datamodule).__name__}.{hook}_dataloader() returned None; return the "
                f"loader to {stage} on."
            )
        return None, loader
    train = datamodule.train_dataloader()
    val = None
    has_step = getattr(type(model), "validation_step", None) is not getattr(
        _module_class(), "validation_step", None
    )
    if has_step:
        val = datamodule.val_dataloader()
    elif type(datamodule).val_dataloader is not DataModule.val_dataloader:
        warn_unused_val_loader(model)
    return train, val


def _module_class() -> type[Any]:
    from accord.module import Module

    return Module
