"""Seconds per epoch: the same MLP fit by a raw loop, accord and Lightning.

``--ranks 1`` runs on one device in this process; ``--ranks 2`` runs two real processes on
gloo (raw side: DistributedDataParallel + DistributedSampler), with each framework's
``ddp`` strategy joining the process group the benchmark created, as under torchrun.

An epoch is timed from the ``on_train_epoch_start`` of epoch 1 to ``on_train_end`` (the
raw loop takes its timestamps at the same places); epoch 0 is a warm-up.
"""

from __future__ import annotations

import statistics
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
    now,
    parser,
    peers,
    quiet_lightning,
    section,
    set_threads,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accord

OVERHEAD_GOAL_US = 15.0
"""The most time per training step accord may add to the raw loop."""


class AccordMlp(accord.Module):
    """The benchmark MLP as an accord module, recording epoch timestamps."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.stamps: list[tuple[float, float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())

    def on_train_epoch_start(self) -> None:
        self.stamps.append(now())

    def on_train_end(self) -> None:
        self.stamps.append(now())


def lightning_module() -> type[Any]:
    """The same module for Lightning (built on first use: Lightning may be absent)."""
    import pytorch_lightning as pl

    class LightningMlp(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.stamps: list[tuple[float, float]] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return loss_fn(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

        def on_train_epoch_start(self) -> None:
            self.stamps.append(now())

        def on_train_end(self) -> None:
            self.stamps.append(now())

    return LightningMlp


def _per_epoch(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    # stamps: the start of each epoch, then the end of training; epoch 0 is the warm-up.
    epochs = len(stamps) - 2
    return (
        (stamps[-1][0] - stamps[1][0]) / epochs,
        (stamps[-1][1] - stamps[1][1]) / epochs,
    )


def _loader(data: TensorDataset) -> DataLoader[Any]:
    return DataLoader(
        data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )


def raw_fit(data: TensorDataset, epochs: int, ranks: int) -> tuple[float, float]:
    """The plain PyTorch loop (DDP + DistributedSampler when ``ranks > 1``)."""
    net = make_net()
    sampler: DistributedSampler[Any] | None = None
    if ranks > 1:
        model: torch.nn.Module = DistributedDataParallel(net)
        sampler = DistributedSampler(data, shuffle=True, seed=SEED)
        loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    else:
        model = net
        loader = _loader(data)
    optimizer = make_optimizer(model.parameters())
    stamps = []
    for epoch in range(epochs):
        stamps.append(now())
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stamps.append(now())
    return _per_epoch(stamps)


def accord_fit(data: TensorDataset, epochs: int, ranks: int) -> tuple[float, float]:
    """accord's Trainer: ``single_device``, or ``ddp`` joining the existing group."""
    module = AccordMlp()
    trainer = accord.Trainer(
        strategy="ddp" if ranks > 1 else "single_device",
        accelerator="cpu",
        devices=ranks,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, _loader(data))
    return _per_epoch(module.stamps)


def lightning_fit(data: TensorDataset, epochs: int, ranks: int) -> tuple[float, float]:
    """Lightning's Trainer with the same settings (model summary and sanity checks off too)."""
    import pytorch_lightning as pl

    module = lightning_module()()
    with quiet_lightning():
        trainer = pl.Trainer(
            strategy="ddp" if ranks > 1 else "auto",
            accelerator="cpu",
            devices=ranks,
            max_epochs=epochs,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, _loader(data))
    return _per_epoch(module.stamps)


FITS: dict[str, Callable[[TensorDataset, int, int], tuple[float, float]]] = {
    "raw": raw_fit,
    "accord": accord_fit,
    "lightning": lightning_fit,
}


def measure(
    names: list[str], rounds: int, epochs: int, samples: int, ranks: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleave the named fits; return wall and CPU seconds per epoch, per round."""
    data = make_dataset(samples)
    cpu: dict[str, list[float]] = {name: [] for name in names}

    def contestant(name: str) -> Callable[[], float]:
        def run() -> float:
            wall, used = FITS[name](data, epochs, ranks)
            cpu[name].append(used)
            return wall

        return run

    wall = interleave({name: contestant(name) for name in names}, rounds, warmup=warmup)
    return wall, {name: values[len(values) - rounds :] for name, values in cpu.items()}


def _rank_worker(
    rank: int, world_size: int, names: list[str], rounds: int, epochs: int, samples: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    set_threads(1)
    dist.init_process_group("gloo")
    try:
        return measure(names, rounds, epochs, samples, world_size, warmup=1)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    parse.add_argument("--epochs", type=int, default=None, help="epochs per fit, warm-up included")
    parse.add_argument("--threads", type=int, default=1, help="threads of a single-device run")
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 7)
    epochs = args.epochs or (2 if smoke else 5)
    samples = 512 if smoke else 8192
    taking_part, skipped = peers(smoke, "pytorch_lightning")
    names = ["raw", "accord"] + (["lightning"] if taking_part else [])
    skipped = {"lightning" if k == "pytorch_lightning" else k: v for k, v in skipped.items()}

    if args.ranks == 1:
        threads = set_threads(args.threads)
        results, cpu = measure(names, rounds, epochs, samples, 1, warmup=0 if smoke else 1)
        thread_note = f"1 process, torch.set_num_threads({threads['torch_threads']})"
        key, title = "fit_1", "Seconds per epoch, single device (CPU)"
    else:
        from accord.testing import run_distributed

        per_rank = run_distributed(
            _rank_worker, 2, names, rounds, epochs, samples, timeout=900, env=TORCHRUN_ENV
        )
        # An epoch ends when the slower rank ends it.
        walls = [wall for wall, _ in per_rank]
        results = {
            name: [max(a, b) for a, b in zip(walls[0][name], walls[1][name], strict=True)]
            for name in names
        }
        cpu = per_rank[0][1]
        thread_note = "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"
        key, title = "fit_2", "Seconds per epoch, 2 ranks, gloo (ddp)"
    steps = samples // args.ranks // BATCH_SIZE
    sec = section(
        key,
        title,
        "s/epoch",
        results,
        threads=thread_note,
        ratios=[("accord", "raw", 1.02), ("accord", "lightning", 0.8)],
        skipped=skipped,
        notes=[
            f"{samples} samples, batch {BATCH_SIZE}, {steps} steps per epoch per rank, "
            f"{epochs} epochs per fit (epoch 0 untimed), {rounds} interleaved rounds",
        ],
        extra={"steps_per_epoch": steps},
    )
    for row in sec["rows"]:
        row["us_per_step"] = row["median"] / steps * 1e6
    sec["notes"].append(
        "per step: "
        + ", ".join(f"{r['contestant']} {r['us_per_step']:.0f} µs" for r in sec["rows"])
    )
    sec["notes"].append(
        "CPU time per epoch (process time, rank 0), median: "
        + ", ".join(f"{name} {statistics.median(v):.3g} s" for name, v in cpu.items())
    )
    sec["cpu_s_per_epoch"] = cpu
    # What the framework adds to each step, from the medians (wall, and rank 0's CPU time).
    per_step = {row["contestant"]: row["us_per_step"] for row in sec["rows"]}
    overhead = per_step["accord"] - per_step["raw"]
    cpu_overhead = (statistics.median(cpu["accord"]) - statistics.median(cpu["raw"])) / steps * 1e6
    sec["notes"].append(
        f"per-step overhead, accord - raw: {overhead:.1f} µs wall, {cpu_overhead:.1f} µs CPU"
    )
    sec["goal_rows"] = [
        {
            "name": "per-step overhead, accord - raw (wall)",
            "measured": f"{overhead:.1f} µs",
            "goal": f"≤ {OVERHEAD_GOAL_US:g} µs",
            "met": overhead <= OVERHEAD_GOAL_US,
        }
    ]
    emit("bench_fit", [sec], args.json)


if __name__ == "__main__":
    main()
