"""An epoch's rest dealt again over the ranks left after a change of members
(``on_rank_loss="continue"``): in windows of the global batch, or by a new sampler."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from accord.trainer.data import _batch_size, _rebuild, global_order, sampler_of

__all__ = ["reshard", "window_loader"]


def window_loader(
    loader: DataLoader[Any],
    order: dict[str, Any],
    consumed: int,
    window: int,
    replicas: int,
    rank: int,
) -> tuple[DataLoader[Any], list[float]]:
    """This rank's loader for the rest of an epoch whose global batch stays ``window``
    positions of the epoch's global order, on however many ranks are left; and the weight
    of each of its batches' loss.

    From ``consumed`` on, the order is cut into windows (the last may be shorter), each
    dealt round-robin over the ``replicas`` ranks: with the world the epoch began with,
    exactly the batches `DistributedSampler` gives. A rank's batch then holds ``n`` of a
    window's ``m`` positions, and its loss counts ``replicas * n / m`` times: with the
    gradient averaged over the ranks, the step is the mean over the window's samples, the
    full world's step. A rank that a short window leaves without a sample takes the
    window's first one with weight 0, so every rank still takes part in the step.
    """
    rest = global_order(order)[consumed:]
    batches: list[list[int]] = []
    weights: list[float] = []
    for start in range(0, len(rest), window):
        chunk = rest[start : start + window]
        mine = chunk[rank::replicas]
        weights.append(replicas * len(mine) / len(chunk) if mine else 0.0)
        batches.append(mine or chunk[:1])
    return _rebuild(loader, batch_sampler=_Batches(batches)), weights


def reshard(loader: Iterable[Any], sampler_kwargs: dict[str, int] | None) -> Iterable[Any]:
    """``loader`` with the `DistributedSampler` `prepare_loader` gave it replaced by one
    over the ranks ``sampler_kwargs`` names (the group changed members); any other loader
    as it is."""
    sampler = sampler_of(loader)
    if (
        sampler_kwargs is None
        or not isinstance(loader, DataLoader)
        or not isinstance(sampler, DistributedSampler)
    ):
        return loader
    fresh: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
        **sampler_kwargs,
    )
    fresh.set_epoch(sampler.epoch)
    given = loader.batch_sampler if loader.batch_size is None else None
    if given is not None:
        size = _batch_size(loader)
        assert size is not None
        drop_last = bool(getattr(given, "drop_last", False))
        return _rebuild(loader, batch_sampler=BatchSampler(fresh, size, drop_last))
    return _rebuild(loader, batch_size=loader.batch_size, sampler=fresh, drop_last=loader.drop_last)


class _Batches(Sampler[list[int]]):
    """Yields the given batches of dataset indices, in order."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
