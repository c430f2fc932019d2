"""Seconds per epoch of accord's ``ddp`` when the collective carries the gradients.

Two real processes on gloo, as ``bench_fit.py --ranks 2``: the Trainer's ``ddp`` joins the
process group the benchmark created, and every contestant fits the same MLP on the same
data. ``native`` is ``DDPStrategy(gradient_sync="native")`` (DDP's reducer all-reduces
each gradient bucket on the process group itself); ``collective`` is
``DDPStrategy(gradient_sync="collective")``, whose communication hook hands every bucket to
the strategy's collective as an asynchronous ``all_reduce(bucket, "mean", out=bucket,
async_op=True)`` and returns its future, so backward goes on while the bucket travels.
``raw`` is the plain DistributedDataParallel loop, for reference.

An epoch is timed from the ``on_train_epoch_start`` of epoch 1 to ``on_train_end`` (the raw
loop takes its timestamps at the same places); epoch 0 is a warm-up. An epoch ends when the
slower rank ends it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from bench_fit import AccordMlp, _loader, _per_epoch, raw_fit
from common import (
    BATCH_SIZE,
    TORCHRUN_ENV,
    emit,
    interleave,
    make_dataset,
    parser,
    section,
    set_threads,
)
from torch.utils.data import TensorDataset

import accord
from accord.strategies import DDPStrategy

CONTESTANTS = ("raw", "native", "collective")


def accord_fit(data: TensorDataset, epochs: int, gradient_sync: str) -> tuple[float, float]:
    """accord's Trainer with ``DDPStrategy(gradient_sync=...)``, joining the existing group."""
    module = AccordMlp()
    trainer = accord.Trainer(
        strategy=DDPStrategy(gradient_sync=gradient_sync),  # type: ignore[arg-type]
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, _loader(data))
    return _per_epoch(module.stamps)


def _fit(name: str, data: TensorDataset, epochs: int) -> tuple[float, float]:
    if name == "raw":
        return raw_fit(data, epochs, 2)
    return accord_fit(data, epochs, name)


def _rank_worker(
    rank: int, world_size: int, rounds: int, epochs: int, samples: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    threads = set_threads(1)
    dist.init_process_group("gloo")
    try:
        data = make_dataset(samples)
        cpu: dict[str, list[float]] = {name: [] for name in CONTESTANTS}

        def contestant(name: str) -> Callable[[], float]:
            def run() -> float:
                wall, used = _fit(name, data, epochs)
                cpu[name].append(used)
                return wall

            return run

        wall = interleave({name: contestant(name) for name in CONTESTANTS}, rounds, warmup)
        recorded = {name: values[len(values) - rounds :] for name, values in cpu.items()}
        return wall, recorded, threads
    finally:
        dist.destroy_process_group()


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--epochs", type=int, default=None, help="epochs per fit, warm-up included")
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 7)
    epochs = args.epochs or (2 if smoke else 5)
    samples = 512 if smoke else 8192
    from accord.testing import run_distributed

    per_rank = run_distributed(
        _rank_worker,
        2,
        rounds,
        epochs,
        samples,
        0 if smoke else 1,
        timeout=900,
        env=TORCHRUN_ENV,
    )
    walls = [wall for wall, _, _ in per_rank]
    results = {
        name: [max(a, b) for a, b in zip(walls[0][name], walls[1][name], strict=True)]
        for name in CONTESTANTS
    }
    cpu = per_rank[0][1]
    threads = per_rank[0][2]
    steps = samples // 2 // BATCH_SIZE
    sec = section(
        "grad_sync",
        "Seconds per epoch, 2 ranks, gloo: ddp gradients through the collective",
        "s/epoch",
        results,
        threads=(
            f"2 processes x torch.set_num_threads({threads['torch_threads']}), "
            f"OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}"
        ),
        ratios=[("collective", "native", 1.05), ("native", "raw", None)],
        notes=[
            f"{samples} samples, batch {BATCH_SIZE}, {steps} steps per epoch per rank, "
            f"{epochs} epochs per fit (epoch 0 untimed), {rounds} interleaved rounds",
            'native = DDPStrategy(gradient_sync="native"); collective = '
            'DDPStrategy(gradient_sync="collective"), each bucket through '
            "collective.all_reduce(..., async_op=True); raw = DistributedDataParallel loop",
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
    emit("bench_grad_sync", [sec], args.json)


if __name__ == "__main__":
    main()
