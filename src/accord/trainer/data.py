"""The Trainer's data: where loaders come from, each rank's shard, and batches per epoch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from accord.errors import ConfigurationError
from accord.module import Module

__all__ = [
    "module_loader",
    "num_batches",
    "overrides",
    "prepare_loader",
    "sampler_of",
    "set_epoch",
]

# Stands for "no end" where a loader has no length: larger than any real batch count.
_UNBOUNDED = 2**62


def overrides(model: Module, name: str) -> bool:
    """Whether ``model``'s class defines its own ``name`` hook instead of `Module`'s."""
    return getattr(type(model), name, None) is not getattr(Module, name, None)


def module_loader(model: Module, name: str, required: bool = True) -> Any:
    """The loader ``model.<name>()`` returns (``train_dataloader``, ...).

    Raises:
        ConfigurationError: the module has no such method and ``required`` is set.
    """
    method = getattr(model, name, None)
    if callable(method):
        return method()
    if required:
        raise ConfigurationError(
            f"No dataloader given and {type(model).__name__} has no {name}(). Pass one to the "
            "Trainer method, or define the method on the module."
        )
    return None


def sampler_of(loader: Iterable[Any]) -> Any:
    """The sampler that orders a loader's samples: inside a batch_sampler the user gave."""
    if getattr(loader, "batch_size", 0) is None:
        return getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return getattr(loader, "sampler", None)


def set_epoch(loader: Iterable[Any], epoch: int) -> None:
    """Tell the loader's sampler the epoch, so a shuffled order differs between epochs."""
    setter = getattr(sampler_of(loader), "set_epoch", None)
    if callable(setter):
        setter(epoch)


def prepare_loader(
    loader: Iterable[Any], stage: str, sampler_kwargs: dict[str, int] | None
) -> Iterable[Any]:
    """Give a multi-rank run a `DistributedSampler`, so each rank sees its own share.

    ``sampler_kwargs`` is the strategy's ``distributed_sampler_kwargs``. A loader that is
    not a `DataLoader`, one over an `IterableDataset`, or one already sharded is returned
    as it is.

    Raises:
        ConfigurationError: the loader has a custom batch sampler, which cannot be sharded.
    """
    if (
        sampler_kwargs is None
        or sampler_kwargs["num_replicas"] == 1
        or not isinstance(loader, DataLoader)
    ):
        return loader
    if isinstance(loader.dataset, IterableDataset) or isinstance(
        sampler_of(loader), DistributedSampler
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
        loader.dataset, shuffle=shuffle, drop_last=False, **sampler_kwargs
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


def num_batches(loader: Iterable[Any], limit: int | float | None) -> int:
    """Batches to run from ``loader``: all, a count, or a fraction (``limit_*_batches``)."""
    try:
        available: float = len(loader)  # type: ignore[arg-type]
    except TypeError:
        available = math.inf
    if limit is None:
        count = available
    elif isinstance(limit, float):
        count = int(available * limit) if available != math.inf else available
    else:
        count = min(limit, available)
    return int(count) if count != math.inf else _UNBOUNDED
