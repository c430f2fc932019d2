"""The Trainer's data: where loaders come from, each rank's shard, and batches per epoch."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from accord.errors import CheckpointError, ConfigurationError
from accord.module import Module

__all__ = [
    "epoch_order",
    "global_seed",
    "global_order",
    "num_batches",
    "overrides",
    "prepare_loader",
    "resume_loader",
    "sampler_of",
    "samples_per_batch",
    "set_epoch",
]

# Stands for "no end" where a loader has no length: larger than any real batch count.
_UNBOUNDED = 2**62


def overrides(model: Module, name: str) -> bool:
    """Whether ``model``'s class defines its own ``name`` hook instead of `Module`'s."""
    return getattr(type(model), name, None) is not getattr(Module, name, None)


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
    loader: Iterable[Any],
    stage: str,
    sampler_kwargs: dict[str, int] | None,
    *,
    distributed_sampler: bool = True,
    overfit: bool = False,
) -> Iterable[Any]:
    """Give a multi-rank run a `DistributedSampler`, so each rank sees its own share.

    ``sampler_kwargs`` is the strategy's ``distributed_sampler_kwargs``. The sampler is
    seeded from `accord.seed_everything`'s seed (``ACCORD_SEED``, 0 without one), as
    Lightning seeds its own from ``seed_everything``, so a seed changes the shuffled order.
    A predict loader is split without padding, so each sample is predicted once. A loader
    that is not a `DataLoader`, one over an `IterableDataset`, one already sharded, and any
    loader with ``distributed_sampler=False`` (``Trainer(use_distributed_sampler=False)``)
    is returned as it is. ``overfit`` (``overfit_batches``) turns a training loader's
    shuffling off.

    Raises:
        ConfigurationError: the loader has a custom batch sampler, which cannot be sharded.
    """
    if not isinstance(loader, DataLoader):
        return loader
    if overfit and stage == "train":
        loader = _in_order(loader)
    if (
        not distributed_sampler
        or sampler_kwargs is None
        or sampler_kwargs["num_replicas"] == 1
        or isinstance(loader.dataset, IterableDataset)
        or isinstance(sampler_of(loader), DistributedSampler)
    ):
        return loader
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise ConfigurationError(
            f"The {stage} DataLoader uses a custom batch_sampler "
            f"({type(batch_sampler).__name__}), which accord cannot shard across ranks. "
            "Shard it yourself: build it over a DistributedSampler(dataset, "
            "num_replicas=trainer.world_size, rank=trainer.global_rank), and pass "
            "Trainer(use_distributed_sampler=False)."
        )
    # A batch_sampler the user passed (batch_size is then None) keeps its batch size and
    # drop_last; only the sampler inside it is replaced by this rank's shard.
    given = batch_sampler if loader.batch_size is None else None
    inner = given.sampler if given is not None else loader.sampler
    sampler: Sampler[int]
    if stage == "predict":
        # No padding: each sample is predicted once, on one rank.
        length = len(loader.dataset)  # type: ignore[arg-type]
        rank, replicas = sampler_kwargs["rank"], sampler_kwargs["num_replicas"]
        sampler = _Indices(list(range(rank, length, replicas)))
    else:
        shuffle = stage == "train" and isinstance(inner, RandomSampler)
        sampler = DistributedSampler(
            loader.dataset, shuffle=shuffle, drop_last=False, seed=global_seed(), **sampler_kwargs
        )
    if given is not None:
        return _rebuild(
            loader, batch_sampler=BatchSampler(sampler, given.batch_size, given.drop_last)
        )
    return _rebuild(
        loader, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last
    )


def global_seed() -> int:
    """The seed `accord.seed_everything` set (``ACCORD_SEED``), or 0."""
    try:
        return int(os.environ.get("ACCORD_SEED", "0"))
    except ValueError:
        return 0


def _in_order(loader: DataLoader[Any]) -> DataLoader[Any]:
    """``loader`` with a shuffling sampler replaced by one in order (``overfit_batches``)."""
    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        return loader
    if not isinstance(loader.sampler, RandomSampler):
        return loader
    rank_zero_warn(
        "overfit_batches turns off the training loader's shuffling: the same batches are "
        "seen every epoch.",
        category=UserWarning,
    )
    return _rebuild(
        loader,
        batch_size=loader.batch_size,
        sampler=SequentialSampler(loader.dataset),  # type: ignore[arg-type]
        drop_last=loader.drop_last,
    )


def _rebuild(loader: DataLoader[Any], **batching: Any) -> DataLoader[Any]:
    """A loader like ``loader`` over the same dataset, batched as ``batching`` says."""
    extra: dict[str, Any] = dict(batching)
    if loader.num_workers > 0:
        extra.update(
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
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


def epoch_order(
    loader: Iterable[Any], rng_epoch_start: torch.Tensor | None
) -> dict[str, Any] | None:
    """How ``loader`` orders this epoch's samples over all ranks, as a checkpoint records it.

    The record names one global order of dataset indices (see `global_order`): a
    `DistributedSampler`'s (its seed, epoch and padding, whatever the number of ranks), a
    `SequentialSampler`'s, or a `RandomSampler`'s drawn from the global RNG as it was when
    the epoch's iterator was made (``rng_epoch_start``). Each rank's batches take the
    positions of that order round-robin, so ``batches * batch_size * ranks`` positions from
    its start are consumed. None for an order accord cannot reproduce (an iterable dataset,
    a custom sampler, a sampler or loader with its own generator).
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    if _batch_size(loader) is None:
        return None
    sampler = sampler_of(loader)
    length = len(loader.dataset)  # type: ignore[arg-type]
    if isinstance(sampler, DistributedSampler):
        return {
            "kind": "distributed",
            "dataset_length": length,
            "length": sampler.total_size,
            "shuffle": bool(sampler.shuffle),
            "seed": int(sampler.seed),
            "epoch": int(sampler.epoch),
            "drop_last": bool(sampler.drop_last),
        }
    if type(sampler) is SequentialSampler:
        return {"kind": "sequential", "dataset_length": length, "length": length}
    if (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler._num_samples is None
        and sampler.generator is None
        and loader.generator is None
        and rng_epoch_start is not None
    ):
        return {
            "kind": "random",
            "dataset_length": length,
            "length": length,
            "rng": rng_epoch_start.clone(),
        }
    return None


def global_order(order: dict[str, Any]) -> list[int]:
    """The dataset indices of one epoch, in the order `epoch_order` recorded.

    Raises:
        CheckpointError: ``order`` is not a record `epoch_order` writes.
    """
    kind, length = order.get("kind"), int(order.get("dataset_length", -1))
    if kind == "sequential":
        return list(range(length))
    if kind == "random":
        # A DataLoader over a RandomSampler draws its workers' base seed, then the
        # sampler's seed, from the global RNG; replay both from the epoch's start.
        saved = torch.get_rng_state()
        try:
            torch.set_rng_state(order["rng"])
            torch.empty((), dtype=torch.int64).random_()
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        finally:
            torch.set_rng_state(saved)
        generator = torch.Generator()
        generator.manual_seed(seed)
        return list(torch.randperm(length, generator=generator).tolist())
    if kind == "distributed":
        if order["shuffle"]:
            generator = torch.Generator()
            generator.manual_seed(int(order["seed"]) + int(order["epoch"]))
            indices: list[int] = torch.randperm(length, generator=generator).tolist()
        else:
            indices = list(range(length))
        total = int(order["length"])
        if order["drop_last"] or total <= len(indices):
            return indices[:total]
        padding = total - len(indices)
        repeats = math.ceil(padding / len(indices))
        return indices + (indices * repeats)[:padding]
    raise CheckpointError(
        f"The checkpoint's data order {kind!r} is not one accord writes; the checkpoint is "
        "damaged or from another program. Resume from an epoch's end, or another checkpoint."
    )


def samples_per_batch(loader: Iterable[Any], num_replicas: int) -> int | None:
    """Positions of the epoch's global order one batch on every rank consumes, or None."""
    size = _batch_size(loader) if isinstance(loader, DataLoader) else None
    return None if size is None else size * num_replicas


def resume_loader(
    loader: DataLoader[Any], order: dict[str, Any], consumed: int, num_replicas: int, rank: int
) -> DataLoader[Any]:
    """This rank's loader for the rest of an epoch begun under another run.

    The positions of the epoch's global order (``order``, see `epoch_order`) from
    ``consumed`` on are dealt round-robin over the ``num_replicas`` ranks of this run (the
    last ones repeated from the start of the rest, as `DistributedSampler` pads, so every
    rank gets as many), and batched as ``loader`` batches.
    """
    rest = global_order(order)[consumed:]
    if rest and len(rest) % num_replicas:
        padding = num_replicas - len(rest) % num_replicas
        rest = rest + (rest * math.ceil(padding / len(rest)))[:padding]
    sampler = _Indices(rest[rank::num_replicas])
    given = loader.batch_sampler if loader.batch_size is None else None
    if given is not None:
        size, drop_last = _batch_size(loader), bool(getattr(given, "drop_last", False))
        assert size is not None
        return _rebuild(loader, batch_sampler=BatchSampler(sampler, size, drop_last))
    return _rebuild(
        loader, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last
    )


def _batch_size(loader: DataLoader[Any]) -> int | None:
    if loader.batch_size is not None:
        return int(loader.batch_size)
    size = getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) else None


class _Indices(Sampler[int]):
    """Yields the given dataset indices, in order."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
