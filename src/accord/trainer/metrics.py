"""What ``self.log`` records, and how it is synced: one collective call per flush.

Step values logged with ``sync_dist=True`` are stacked into one vector and gathered with a
single ``all_gather``; each metric is then reduced locally with its own ``reduce_fx``.
Epoch aggregates keep a running total and weight per rank and are synced the same way,
once, at the end of the epoch, so an epoch mean is exact across ranks with unequal batches.

Names follow Lightning: a value logged with both ``on_step`` and ``on_epoch`` is kept as
``<name>_step`` and ``<name>_epoch``, and ``callback_metrics`` also holds it under the bare
``<name>`` (the step value during a training epoch, the epoch aggregate once it ends), so a
callback can monitor the name that was logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.core.strategy import Strategy

__all__ = ["MetricStore"]

_FXS = ("mean", "sum", "max", "min")


@dataclass
class _Options:
    prog_bar: bool
    logger: bool
    reduce_fx: str
    sync_dist: bool
    # The name as logged, when the key carries a _step/_epoch suffix.
    bare: str | None = None


@dataclass
class _Aggregate:
    options: _Options
    total: float
    weight: float


class MetricStore:
    """Collects logged values for one run and hands out synced results.

    Attributes:
        callback_metrics: the latest value of every metric, for callbacks.
        progress_bar_metrics: the latest value of each ``prog_bar=True`` metric.
        logged_metrics: the latest value of each metric handed to the loggers.
    """

    def __init__(self) -> None:
        self.in_step = False
        self.stage = "train"
        # The current step's values, and (training) its epoch contributions waiting for
        # the ranks to agree that the step counts; the loops test them before calling in.
        self.step_values: dict[str, tuple[_Options, torch.Tensor]] = {}
        self._epochs: dict[str, dict[str, _Aggregate]] = {}
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.collective_calls = 0
        # A training step's epoch contributions wait until the ranks agree the step counts.
        self.pending: list[tuple[str, _Options, float, float]] = []
        # The batch of the step running, set by the loops: an epoch mean's default weight
        # is its size, as Lightning infers it.
        self.batch: Any = None
        self._sized: Any = None
        self._size = 1

    def log(
        self,
        name: str,
        value: torch.Tensor | float,
        *,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str,
        sync_dist: bool,
        batch_size: int | None,
    ) -> None:
        """Record one value (see `accord.Module.log` for the arguments)."""
        fx = reduce_fx.lower()
        if fx not in _FXS:
            raise ConfigurationError(
                f"self.log({name!r}, reduce_fx={reduce_fx!r}): use one of {list(_FXS)}."
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(
                    f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log one "
                    "number (e.g. value.mean())."
                )
            number = value.detach().reshape(()).float()
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = torch.tensor(float(value))
        else:
            raise ConfigurationError(
                f"self.log({name!r}) got {type(value).__name__}; log a number or a one-element "
                "tensor."
            )
        training_step = self.in_step and self.stage == "train"
        step = training_step if on_step is None else on_step
        epoch = (not training_step) if on_epoch is None else on_epoch
        if batch_size is None and epoch and fx == "mean" and self.in_step:
            batch_size = self._batch_size()
        forked = step and epoch
        if step:
            # As in Lightning, only a training step's value stands in for the bare name.
            bare = name if forked and self.stage == "train" else None
            options = _Options(prog_bar, logger, fx, sync_dist, bare)
            self.step_values[f"{name}_step" if forked else name] = (options, number)
        if epoch:
            key = f"{name}_epoch" if forked else name
            options = _Options(prog_bar, logger, fx, sync_dist, name if forked else None)
            entry = (key, options, float(number), float(batch_size or 1))
            if training_step:
                self.pending.append(entry)
            else:
                _accumulate(self._epochs.setdefault(self.stage, {}), *entry)

    def _batch_size(self) -> int:
        """The size of the running step's batch (its first tensor's first dimension)."""
        batch = self.batch
        if batch is not self._sized:
            self._sized, self._size = batch, batch_size_of(batch)
        return self._size

    def end_training_step(self, skipped: bool) -> None:
        """Keep what the training step logged, or drop all of it when the step was skipped.

        Every rank drops the same steps, so the next sync has the same metrics on each.
        """
        pending, self.pending = self.pending, []
        if skipped:
            self.step_values = {}
            return
        store = self._epochs.setdefault(self.stage, {})
        for entry in pending:
            _accumulate(store, *entry)

    def flush_step(self, strategy: Strategy) -> dict[str, float]:
        """Sync this step's values (one collective call if any asks for it) and return them."""
        if not self.step_values:
            return {}
        items = sorted(self.step_values.items())
        self.step_values = {}
        synced = [(k, o, v) for k, (o, v) in items if o.sync_dist and strategy.world_size > 1]
        combined: dict[str, float] = {}
        if synced:
            stacked = torch.stack([v for _, _, v in synced]).to(strategy.root_device)
            gathered = strategy.all_gather(stacked.unsqueeze(0), even=True).cpu()
            self.collective_calls += 1
            # One reduction per reduce_fx over all the columns, not a few small ops per metric.
            columns = gathered.double()
            by_fx = {
                fx: _combine_columns(columns, fx).tolist()
                for fx in {o.reduce_fx for _, o, _ in synced}
            }
            for column, (key, options, _) in enumerate(synced):
                combined[key] = by_fx[options.reduce_fx][column]
        values = {k: combined[k] if k in combined else float(v) for k, (_, v) in items}
        opts = {k: o for k, (o, _) in items}
        # As in Lightning, an evaluation step's values reach the loggers, not the callbacks.
        self._publish(values, opts, callbacks=self.stage == "train")
        return {k: v for k, v in values.items() if opts[k].logger}

    def flush_epoch(self, strategy: Strategy, stage: str) -> dict[str, float]:
        """Sync ``stage``'s epoch aggregates (one collective call if any asks); return them."""
        epoch = self._epochs.pop(stage, {})
        if not epoch:
            return {}
        items = sorted(epoch.items())
        values: dict[str, float] = {}
        synced = [(k, a) for k, a in items if a.options.sync_dist and strategy.world_size > 1]
        if synced:
            rows = torch.tensor([[a.total, a.weight] for _, a in synced], dtype=torch.float64)
            gathered = strategy.all_gather(rows.unsqueeze(0).to(strategy.root_device), even=True)
            self.collective_calls += 1
            per_rank = gathered.cpu()
            for index, (key, agg) in enumerate(synced):
                totals, weights = per_rank[:, index, 0], per_rank[:, index, 1]
                values[key] = _finish_epoch(totals, weights, agg.options.reduce_fx)
        for key, agg in items:
            if key not in values:
                values[key] = _finish_epoch(
                    torch.tensor([agg.total]), torch.tensor([agg.weight]), agg.options.reduce_fx
                )
        self._publish(values, {k: a.options for k, a in items})
        return {k: values[k] for k, a in items if a.options.logger}

    def _publish(
        self, values: dict[str, float], options: dict[str, _Options], callbacks: bool = True
    ) -> None:
        for key, number in values.items():
            if callbacks:
                tensor = torch.tensor(number)
                self.callback_metrics[key] = tensor
                bare = options[key].bare
                if bare is not None:
                    self.callback_metrics[bare] = tensor
            if options[key].prog_bar:
                self.progress_bar_metrics[key] = number

    def reset(self, stage: str) -> None:
        """Drop ``stage``'s unfinished aggregates and any unflushed step values."""
        self._epochs.pop(stage, None)
        self.step_values = {}
        self.pending = []


def batch_size_of(batch: Any) -> int:
    """The size of a batch as Lightning infers it: the first dimension of the first tensor
    found in it (1 for a 0-d tensor or a batch without tensors)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            size = batch_size_of(item)
            if size != 1 or isinstance(item, torch.Tensor):
                return size
    return 1


def _accumulate(
    store: dict[str, _Aggregate], key: str, options: _Options, value: float, weight: float
) -> None:
    agg = store.get(key)
    if agg is None:
        total = value * weight if options.reduce_fx == "mean" else value
        store[key] = _Aggregate(options, total, weight)
        return
    fx = options.reduce_fx
    if fx == "mean":
        agg.total += value * weight
    elif fx == "sum":
        agg.total += value
    elif fx == "max":
        agg.total = max(agg.total, value)
    else:
        agg.total = min(agg.total, value)
    agg.weight += weight


def _combine(values: torch.Tensor, fx: str) -> float:
    if fx == "mean":
        return float(values.double().mean())
    if fx == "sum":
        return float(values.double().sum())
    if fx == "max":
        return float(values.max())
    return float(values.min())


def _combine_columns(values: torch.Tensor, fx: str) -> torch.Tensor:
    """`_combine` of each column of ``values`` (ranks x metrics) at once."""
    if fx == "mean":
        return values.mean(0)
    if fx == "sum":
        return values.sum(0)
    if fx == "max":
        return values.max(0).values
    return values.min(0).values


def _finish_epoch(totals: torch.Tensor, weights: torch.Tensor, fx: str) -> float:
    if fx == "mean":
        return float(totals.double().sum() / weights.double().sum())
    return _combine(totals, fx)
