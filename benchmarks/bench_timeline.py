"""What recording the collectives costs: a DDP epoch with ``profiler="timeline"`` vs off.

Two real processes on gloo (as ``bench_fit.py --ranks 2``: the Trainer's ``ddp`` joins the
process group the benchmark created). The module logs its loss with ``sync_dist=True``, so
every step makes collective calls through the strategy's collective, which the timeline
records; DDP's own gradient all-reduce runs in its C++ reducer and is the same for both.
Epochs are timed as in ``bench_fit.py`` (``on_train_epoch_start`` of epoch 1 to
``on_train_end``), so the merge and the file written after the fit are not in the figure;
they are timed separately. A second table is the cost per call of the recording layer
alone: ``all_reduce`` of a scalar on the one-process collective, bare, under a wrapper that
only forwards, and under a `RecordingCollective`, in process time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    BATCH_SIZE,
    SEED,
    TORCHRUN_ENV,
    cpu_ticks,
    emit,
    interleave,
    loss_fn,
    make_dataset,
    make_net,
    make_optimizer,
    now,
    parser,
    section,
    set_threads,
    steal_percent,
)
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.collectives import SingleDeviceCollective
from accord.core.wrappers.recorder import RecordingCollective
from accord.core.wrappers.wrapper import CollectiveWrapper


class LoggingMlp(accord.Module):
    """The benchmark MLP, logging its loss across ranks every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.stamps: list[tuple[float, float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self.net, batch)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())

    def on_train_epoch_start(self) -> None:
        self.stamps.append(now())

    def on_train_end(self) -> None:
        self.stamps.append(now())


def _fit(data: TensorDataset, epochs: int, profiler: str | None, root: str) -> dict[str, float]:
    module = LoggingMlp()
    trainer = accord.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
        profiler=profiler,
    )
    loader = DataLoader(
        data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    started = time.perf_counter()
    trainer.fit(module, loader)
    total = time.perf_counter() - started
    stamps = module.stamps
    timed = len(stamps) - 2
    return {
        "epoch": (stamps[-1][0] - stamps[1][0]) / timed,
        "cpu": (stamps[-1][1] - stamps[1][1]) / timed,
        # After the last epoch: the teardown, and for the timeline the gather and the file.
        "after": total - (stamps[-1][0] - stamps[0][0]),
    }


def _rank_worker(
    rank: int, world_size: int, rounds: int, epochs: int, samples: int
) -> dict[str, dict[str, list[float]]]:
    set_threads(1)
    dist.init_process_group("gloo")
    data = make_dataset(samples)
    extra: dict[str, dict[str, list[float]]] = {"cpu": {}, "after": {}}
    try:
        with tempfile.TemporaryDirectory() as root:

            def contestant(profiler: str | None, name: str) -> Any:
                def run() -> float:
                    result = _fit(data, epochs, profiler, root)
                    extra["cpu"].setdefault(name, []).append(result["cpu"])
                    extra["after"].setdefault(name, []).append(result["after"])
                    return result["epoch"]

                return run

            wall = interleave(
                {"off": contestant(None, "off"), "timeline": contestant("timeline", "timeline")},
                rounds,
                warmup=1,
            )
            trace = Path(root) / "collective-timeline-fit.json"
            calls = trace.read_text().count('"ph": "X"') // 2 if trace.exists() else 0
    finally:
        dist.destroy_process_group()
    return {
        "wall": wall,
        "cpu": {k: v[-rounds:] for k, v in extra["cpu"].items()},
        "after": {k: v[-rounds:] for k, v in extra["after"].items()},
        "calls": {"per_rank": [float(calls)]},
    }


def _per_call(rounds: int, calls: int) -> dict[str, list[float]]:
    """CPU µs per ``all_reduce`` of a scalar on the one-process collective: bare, under a
    wrapper that only forwards, and recorded."""
    bare = SingleDeviceCollective().setup()
    forwarding = CollectiveWrapper(SingleDeviceCollective()).setup()
    recorded = RecordingCollective(SingleDeviceCollective(), 512).setup()
    tensor = torch.ones(())

    def timed(collective: Any) -> Any:
        def run() -> float:
            # Process time: other load on the machine hardly moves it, unlike wall time.
            started = time.process_time()
            for _ in range(calls):
                collective.all_reduce(tensor)
            return (time.process_time() - started) / calls * 1e6

        return run

    contestants = {"bare": timed(bare), "wrapper": timed(forwarding)}
    contestants["recorded"] = timed(recorded)
    return interleave(contestants, rounds, warmup=1)


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--epochs", type=int, default=None, help="epochs per fit, warm-up included")
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 7)
    epochs = args.epochs or (2 if smoke else 5)
    samples = 512 if smoke else 8192
    from accord.testing import run_distributed

    before = cpu_ticks()
    per_rank = run_distributed(
        _rank_worker, 2, rounds, epochs, samples, timeout=900, env=TORCHRUN_ENV
    )
    fit_steal = steal_percent(before, cpu_ticks())
    walls = [result["wall"] for result in per_rank]
    # An epoch ends when the slower rank ends it.
    results = {
        name: [max(a, b) for a, b in zip(walls[0][name], walls[1][name], strict=True)]
        for name in ("off", "timeline")
    }
    cpu_both = [result["cpu"] for result in per_rank]
    cpu_samples = {
        name: [a + b for a, b in zip(cpu_both[0][name], cpu_both[1][name], strict=True)]
        for name in ("off", "timeline")
    }
    steps = samples // 2 // BATCH_SIZE
    calls = int(per_rank[0]["calls"]["per_rank"][0])
    after = per_rank[0]["after"]
    cpu = per_rank[0]["cpu"]
    threads = "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"
    fit = section(
        "timeline_fit",
        'Seconds per epoch, 2 ranks, gloo (ddp), profiler="timeline" vs off',
        "s/epoch",
        results,
        threads=threads,
        ratios=[("timeline", "off", 1.05)],
        notes=[
            f"{samples} samples, batch {BATCH_SIZE}, {steps} steps per epoch per rank, "
            f"{epochs} epochs per fit (epoch 0 untimed), {rounds} interleaved rounds; "
            "the module logs its loss with sync_dist=True every step",
            f"collective calls recorded per rank in the last fit: {calls} "
            f"({calls / (steps * epochs):.1f} per step)",
            "CPU time per epoch (process time, rank 0), median: "
            + ", ".join(f"{name} {statistics.median(v):.3g} s" for name, v in cpu.items()),
            "after the last epoch (teardown; for the timeline also the gather and the file), "
            "rank 0, median: "
            + ", ".join(f"{name} {statistics.median(v):.3g} s" for name, v in after.items()),
            f"CPU steal {fit_steal} % while the fits ran",
        ],
    )
    fit_cpu = section(
        "timeline_fit_cpu",
        'CPU seconds per epoch (both ranks), 2 ranks, gloo (ddp), profiler="timeline" vs off',
        "s/epoch",
        cpu_samples,
        threads=threads,
        ratios=[("timeline", "off", 1.05)],
        notes=[
            "the same fits as the table above; process time of both ranks added, which "
            "other load on the machine hardly moves (wall time waits for it)",
        ],
    )
    set_threads(1)
    per_call_rounds = rounds if smoke else 15
    before = cpu_ticks()
    micro = _per_call(per_call_rounds, 200 if smoke else 20_000)
    call_steal = steal_percent(before, cpu_ticks())
    overhead = statistics.median(micro["recorded"]) - statistics.median(micro["wrapper"])
    call = section(
        "timeline_call",
        "CPU µs per all_reduce of a scalar, one-process collective: bare, forwarded, recorded",
        "µs",
        micro,
        threads="1 process, torch.set_num_threads(1)",
        ratios=[("recorded", "bare", None), ("wrapper", "bare", None)],
        notes=[
            f"recording adds {overhead:.2f} µs per call to a wrapper layer that only forwards "
            "(difference of medians, process time); "
            f"{per_call_rounds} interleaved rounds of back-to-back calls",
            f"CPU steal {call_steal} % while this ran",
        ],
    )
    emit("bench_timeline", [fit, fit_cpu, call], args.json)


if __name__ == "__main__":
    main()
