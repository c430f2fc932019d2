"""Python function calls per training step: accord's loop against the same loop by hand.

Counted, not timed: ``sys.setprofile`` counts every Python ``call`` event over 100
steady-state steps (after 10 warm-up steps) of the benchmark MLP, logging, checkpointing
and the progress bar off. The hand-written loop calls the same module's ``training_step``
and the same optimizer, so everything but the loop itself cancels out. ``--ranks 1`` on
one device; ``--ranks 2`` two gloo processes, raw ``DistributedDataParallel`` against
accord's ``ddp`` joining the same process group. Goal: accord adds at most 25 calls per
step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from common import (
    BATCH_SIZE,
    emit,
    loss_fn,
    make_dataset,
    make_net,
    make_optimizer,
    parser,
    section,
)
from torch.nn.parallel import DistributedDataParallel

import accord
from accord.testing import run_distributed

WARMUP, COUNTED = 10, 100
GOAL = 25


class Counter:
    """Counts Python function calls while it is the profile function."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1


def counted_batches(batches: list[Any], counter: Counter) -> Iterator[Any]:
    """Yield ``batches``; profile from the ``WARMUP``-th to the ``WARMUP + COUNTED``-th."""
    for index, batch in enumerate(batches):
        if index == WARMUP:
            sys.setprofile(counter)
        elif index == WARMUP + COUNTED:
            sys.setprofile(None)
        yield batch
    sys.setprofile(None)


class CountedBatches:
    """A loader of fixed batches whose iteration counts calls (see `counted_batches`)."""

    def __init__(self, batches: list[Any], counter: Counter) -> None:
        self.batches, self.counter = batches, counter

    def __iter__(self) -> Iterator[Any]:
        return counted_batches(self.batches, self.counter)

    def __len__(self) -> int:
        return len(self.batches)


class Mlp(accord.Module):
    """The benchmark MLP as an accord module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        """The raw DDP loop's call: ``DistributedDataParallel(module)(batch)``."""
        return self.training_step(batch, 0)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


def batches(rank: int, world_size: int) -> list[Any]:
    data = make_dataset(BATCH_SIZE * (WARMUP + COUNTED + 2) * world_size)
    x, y = data.tensors
    x, y = x[rank::world_size], y[rank::world_size]
    return [[x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]] for i in range(0, len(x), BATCH_SIZE)]


def raw_calls(rank: int, world_size: int) -> float:
    """Calls per step of the loop written by hand (under DDP on several ranks)."""
    module = Mlp()
    model: torch.nn.Module = module
    if world_size > 1:
        model = DistributedDataParallel(module)
    optimizer = make_optimizer(model.parameters())
    counter = Counter()
    model.train()
    for index, batch in enumerate(counted_batches(batches(rank, world_size), counter)):
        optimizer.zero_grad()
        loss = model(batch) if world_size > 1 else module.training_step(batch, index)
        loss.backward()
        optimizer.step()
    return counter.calls / COUNTED


def accord_calls(rank: int, world_size: int) -> float:
    """Calls per step of accord's loop."""
    counter = Counter()
    loader = CountedBatches(batches(rank, world_size), counter)
    trainer = accord.Trainer(
        strategy="ddp" if world_size > 1 else "single_device",
        devices=world_size,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Mlp(), loader)
    return counter.calls / COUNTED


def _ranked(rank: int, world_size: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return raw_calls(rank, world_size), accord_calls(rank, world_size)
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    sections = []
    for world_size in (1, 2):
        if world_size == 1:
            torch.set_num_threads(1)
            raw, mine = raw_calls(0, 1), accord_calls(0, 1)
        else:
            raw, mine = run_distributed(_ranked, world_size=2)[0]
        extra = mine - raw
        where = "one device" if world_size == 1 else "ddp x2"
        sections.append(
            section(
                f"calls_{world_size}",
                f"Python calls per training step, {where}",
                "calls/step",
                {"raw": [raw], "accord": [mine]},
                threads="1 per rank",
                notes=[f"accord adds {extra:.1f} calls per step (goal <= {GOAL})"],
                extra={"added_calls": extra, "goal": GOAL, "met": extra <= GOAL},
            )
        )
    emit("bench_calls.py", sections, args.json)


if __name__ == "__main__":
    main()
