"""Collectives and seconds per step when a training step logs 10 metrics with ``sync_dist``.

Two real processes on gloo; each framework's ``ddp`` strategy joins the process group the
benchmark created, as under torchrun. Every ``torch.distributed`` collective function is
wrapped in the benchmark processes and counted (outermost calls only, so an op that calls
another op counts once); DDP's gradient all-reduce runs in C++ and is the same for both,
so it is not in the count. A step is the time from one ``on_train_batch_start`` to the next.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import (
    BATCH_SIZE,
    SEED,
    TORCHRUN_ENV,
    emit,
    interleave,
    loss_fn,
    make_dataset,
    make_net,
    make_optimizer,
    parser,
    peers,
    quiet_lightning,
    section,
    set_threads,
    wrap_group_methods,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accord
from accord.testing import run_distributed

METRICS = 10
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveCounter:
    """Counts calls of the ``torch.distributed`` collectives (outermost calls only)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._depth = 0

    @property
    def total(self) -> int:
        """Collective calls so far."""
        return sum(self.counts.values())

    def install(self) -> None:
        """Wrap each collective in ``torch.distributed`` and its ``distributed_c10d`` home."""
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapped)
        wrap_group_methods(self._wrap)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


COUNTER = CollectiveCounter()


class StepProbe:
    """Per-step timestamps and collective counts, taken at each ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.totals: list[int] = []
        self.start_counts: Counter[str] = Counter()

    def mark(self) -> None:
        """Record one step boundary."""
        if not self.times:
            self.start_counts = Counter(COUNTER.counts)
        self.times.append(time.perf_counter())
        self.totals.append(COUNTER.total)

    def result(self, skip: int = 2) -> tuple[float, float, dict[str, float]]:
        """(ms per step, collectives per step, collectives per step by function)."""
        step_times = [b - a for a, b in zip(self.times, self.times[1:], strict=False)][skip:]
        per_step = [b - a for a, b in zip(self.totals, self.totals[1:], strict=False)][skip:]
        steps = len(self.times) - 1
        by_name = {
            name: (COUNTER.counts[name] - self.start_counts[name]) / steps
            for name in COUNTER.counts
            if COUNTER.counts[name] != self.start_counts[name]
        }
        return statistics.median(step_times) * 1e3, statistics.median(per_step), by_name


def _values(loss: torch.Tensor) -> list[torch.Tensor]:
    detached = loss.detach()
    return [detached * (index + 1) for index in range(METRICS)]


class AccordLogging(accord.Module):
    """The benchmark MLP logging 10 synced metrics per step, under accord."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.probe = StepProbe()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self.net, batch)
        for index, value in enumerate(_values(loss)):
            self.log(f"metric_{index}", value, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.probe.mark()

    def on_train_end(self) -> None:
        self.probe.mark()


def lightning_module() -> type[Any]:
    """The same module for Lightning (built on first use: Lightning may be absent)."""
    import pytorch_lightning as pl

    class LightningLogging(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.probe = StepProbe()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = loss_fn(self.net, batch)
            for index, value in enumerate(_values(loss)):
                self.log(f"metric_{index}", value, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.probe.mark()

        def on_train_end(self) -> None:
            self.probe.mark()

    return LightningLogging


def _loader(data: TensorDataset) -> DataLoader[Any]:
    return DataLoader(
        data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )


def raw_fit(data: TensorDataset) -> StepProbe:
    """Plain DDP; the 10 values are stacked and synced with one all_reduce per step."""
    model = DistributedDataParallel(make_net())
    sampler: DistributedSampler[Any] = DistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    optimizer = make_optimizer(model.parameters())
    probe = StepProbe()
    world = dist.get_world_size()
    logged: dict[str, float] = {}
    for batch in loader:
        probe.mark()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stacked = torch.stack(_values(loss))
        dist.all_reduce(stacked)
        for index, value in enumerate(stacked.div_(world).tolist()):
            logged[f"metric_{index}"] = value
    probe.mark()
    return probe


def accord_fit(data: TensorDataset) -> StepProbe:
    """accord's ``ddp`` Trainer."""
    module = AccordLogging()
    accord.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    ).fit(module, _loader(data))
    return module.probe


def lightning_fit(data: TensorDataset) -> StepProbe:
    """Lightning's ``ddp`` Trainer, same settings."""
    import pytorch_lightning as pl

    module = lightning_module()()
    with quiet_lightning():
        pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        ).fit(module, _loader(data))
    return module.probe


FITS: dict[str, Callable[[TensorDataset], StepProbe]] = {
    "raw": raw_fit,
    "accord": accord_fit,
    "lightning": lightning_fit,
}


def _rank_worker(
    rank: int, world_size: int, names: list[str], rounds: int, samples: int
) -> dict[str, Any]:
    set_threads(1)
    COUNTER.install()
    dist.init_process_group("gloo")
    data = make_dataset(samples)
    collectives: dict[str, list[float]] = {name: [] for name in names}
    by_name: dict[str, dict[str, float]] = {}

    def measure(name: str) -> Callable[[], float]:
        def run() -> float:
            ms, per_step, detail = FITS[name](data).result()
            collectives[name].append(per_step)
            by_name[name] = detail
            return ms

        return run

    try:
        times = interleave({name: measure(name) for name in names}, rounds)
        return {"ms": times, "collectives": collectives, "by_name": by_name}
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = parser(__doc__).parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 7)
    samples = 768 if smoke else 8192
    taking_part, skipped = peers(smoke, "pytorch_lightning")
    names = ["raw", "accord"] + (["lightning"] if taking_part else [])
    skipped = {"lightning": skipped["pytorch_lightning"]} if skipped else {}
    per_rank = run_distributed(
        _rank_worker, 2, names, rounds, samples, timeout=900, env=TORCHRUN_ENV
    )
    ms = {
        name: [max(a, b) for a, b in zip(values, per_rank[1]["ms"][name], strict=True)]
        for name, values in per_rank[0]["ms"].items()
    }
    collectives = {
        name: [float(c) for c in values][-len(ms[name]) :]
        for name, values in per_rank[0]["collectives"].items()
    }
    threads = "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"
    steps = samples // 2 // BATCH_SIZE
    detail = "; ".join(
        f"{name}: " + ", ".join(f"{fn} {count:g}" for fn, count in sorted(counts.items()))
        for name, counts in per_rank[0]["by_name"].items()
    )
    accord_calls = statistics.median(collectives["accord"])
    time_section = section(
        "logging_time",
        f"Seconds per step logging {METRICS} metrics with sync_dist=True, 2 ranks, gloo",
        "ms/step",
        ms,
        threads=threads,
        ratios=[("accord", "raw", None), ("accord", "lightning", None)],
        skipped=skipped,
        notes=[
            f"{steps} steps per fit (the first 2 untimed), median step per fit, {rounds} "
            "interleaved rounds, the slower rank's figure",
            "raw = plain DDP that stacks the 10 values and syncs them with one all_reduce",
        ],
    )
    count_section = section(
        "logging_collectives",
        f"Collectives per step logging {METRICS} metrics with sync_dist=True, 2 ranks",
        "collectives/step",
        collectives,
        threads=threads,
        skipped=skipped,
        notes=[f"per step, by function (rank 0): {detail}"],
        extra={
            "by_name": per_rank[0]["by_name"],
            "goal_rows": [
                {
                    # The metrics' one all_gather; the ranks' decision whether the step
                    # counts rides in DDP's gradient reduction.
                    "name": "accord collectives per step",
                    "measured": f"{accord_calls:g}",
                    "goal": "1",
                    "met": accord_calls <= 1,
                }
            ],
        },
    )
    emit("bench_logging", [time_section, count_section], args.json)


if __name__ == "__main__":
    main()
