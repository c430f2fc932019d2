"""Where a run's loaders come from: the loader passed to the Trainer, the datamodule's
loader hooks, or the module's, as Lightning resolves them, asked on each rank after
``setup`` (and again with ``reload_dataloaders_every_n_epochs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.datamodule import DataModule, warn_unused_val_loader
from accord.errors import ConfigurationError
from accord.module import Module
from accord.trainer.hooks import overridden

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["LoaderSource", "eval_source", "fit_sources"]

_HOOKS = {
    "train": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


@dataclass
class LoaderSource:
    """One stage's loader: a loader given to the Trainer, or a hook that makes one.

    Attributes:
        stage: ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``.
        given: the loader passed to the Trainer, or None.
        hook: the datamodule's or module's ``*_dataloader`` method, or None.
    """

    stage: str
    given: Iterable[Any] | None = None
    hook: Callable[[], Any] | None = None

    @property
    def reloadable(self) -> bool:
        """Whether asking again can give a new loader (a hook, not a given loader)."""
        return self.hook is not None

    def load(self) -> Any:
        """The loader: the given one, or what the hook returns now.

        Raises:
            ConfigurationError: a hook returned None.
        """
        if self.hook is None:
            return self.given
        loader = self.hook()
        if loader is None:
            raise ConfigurationError(
                f"{_owner_name(self.hook)}.{_HOOKS[self.stage]}() returned None; return the "
                f"loader to {self.stage} on."
            )
        if isinstance(loader, list | tuple) and loader and all(_is_loader(x) for x in loader):
            raise ConfigurationError(
                f"{_owner_name(self.hook)}.{_HOOKS[self.stage]}() returned {len(loader)} "
                "loaders; accord runs one loader per stage. Combine them into one dataset "
                "(torch.utils.data.ConcatDataset), or run the stage once per loader."
            )
        return loader


def _is_loader(value: Any) -> bool:
    return hasattr(value, "__iter__") and hasattr(value, "dataset")


def _owner_name(hook: Callable[[], Any]) -> str:
    return type(getattr(hook, "__self__", hook)).__name__


def _hook_source(
    stage: str, model: Module, datamodule: DataModule | None, required: bool
) -> LoaderSource | None:
    """The datamodule's ``*_dataloader`` (where it has one), else the module's."""
    name = _HOOKS[stage]
    if datamodule is not None:
        if stage == "validate" and not overridden(datamodule, DataModule, name):
            return None
        return LoaderSource(stage, hook=getattr(datamodule, name))
    if overridden(model, Module, name):
        return LoaderSource(stage, hook=getattr(model, name))
    if required:
        raise ConfigurationError(
            f"No {stage} loader given and {type(model).__name__} has no {name}(). Pass one to "
            "the Trainer method, or define the method on the module (or a datamodule)."
        )
    return None


def fit_sources(
    trainer: Trainer, model: Module, train: Iterable[Any] | None, val: Iterable[Any] | None
) -> tuple[LoaderSource, LoaderSource | None]:
    """A fit's training and validation sources; the validation one is dropped, with a
    warning, when the module has no ``validation_step``."""
    datamodule = trainer.datamodule
    if train is not None:
        train_source = LoaderSource("train", given=train)
    else:
        found = _hook_source("train", model, datamodule, required=True)
        assert found is not None
        train_source = found
    val_source = (
        LoaderSource("validate", given=val)
        if val is not None
        else _hook_source("validate", model, datamodule, required=False)
    )
    if val_source is not None and not overridden(model, Module, "validation_step"):
        warn_unused_val_loader(model)
        val_source = None
    elif val_source is None and overridden(model, Module, "validation_step"):
        rank_zero_warn(
            f"{type(model).__name__} defines validation_step() but this fit has no validation "
            "loader, so no validation runs. Pass val_dataloaders= (or define "
            "val_dataloader()) to validate.",
            category=UserWarning,
        )
    return train_source, val_source


def eval_source(
    trainer: Trainer, model: Module, stage: str, given: Iterable[Any] | None
) -> LoaderSource:
    """The loader source of ``validate``/``test``/``predict``."""
    if given is not None:
        return LoaderSource(stage, given=given)
    found = _hook_source(stage, model, trainer.datamodule, required=True)
    if found is None:
        raise ConfigurationError(
            f"{type(trainer.datamodule).__name__} has no {_HOOKS[stage]}(); define it to "
            f"{stage} with this DataModule, or pass dataloaders= instead."
        )
    return found
