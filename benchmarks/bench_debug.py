"""What debug mode costs: a scalar ``all_reduce`` and a DDP epoch, debug mode vs plain.

Two real processes on gloo. The benchmark creates the process group; each strategy joins
it, as under torchrun. Debug mode is turned on the way users turn it on,
``DDPStrategy(debug=True)``: the strategy's collective is then a `DebugCollective` over a
`RecordingCollective` over the `TorchCollective` (what ``ACCORD_DEBUG_COLLECTIVES=1`` gives
too); plain is ``DDPStrategy()``, the bare `TorchCollective`.

* The scalar table times ``strategy.collective.all_reduce`` of a one-element float32 tensor
  (``sum``): each round starts from a barrier, and in it the contestants take turns call by
  call (`common.interleave_calls`); a sample is the median call of a round, the slower
  rank's.
* The fit table trains the benchmark MLP of ``common.py`` (no logging, as ``bench_fit.py``)
  with ``Trainer(strategy=DDPStrategy(debug=...), devices=2)``; epochs are timed from
  ``on_train_epoch_start`` of epoch 1 to ``on_train_end``. In debug mode DDP sends every
  gradient bucket through the checked collective; the step's decision rides in the
  buckets, as in the plain fit.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
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
    interleave_calls,
    loss_fn,
    make_dataset,
    make_net,
    make_optimizer,
    now,
    parser,
    section,
    set_threads,
    steal_percent,
    wrap_group_methods,
)
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.core.wrappers.debug import DebugCollective
from accord.strategies import DDPStrategy
from accord.testing import run_distributed

THREADS = "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"

# torch.distributed's collectives, counted while `_COUNTER["on"]` (outermost calls only).
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "broadcast",
    "barrier",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
)
_COUNTER: dict[str, Any] = {"on": False, "depth": 0, "calls": 0}


def _count_collectives() -> None:
    """Wrap torch.distributed's collectives so that `_COUNTER` counts them."""

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _COUNTER["on"] and _COUNTER["depth"] == 0:
                _COUNTER["calls"] += 1
            _COUNTER["depth"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _COUNTER["depth"] -= 1

        return call

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, counted(fn))
    wrap_group_methods(lambda _, method: counted(method))


def _counting(on: bool) -> int:
    """Start (``on``) or stop counting; returns the calls counted so far and resets."""
    calls = int(_COUNTER["calls"])
    _COUNTER.update(on=on, calls=0)
    return calls


class Mlp(accord.Module):
    """The benchmark MLP, stamping the epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.stamps: list[tuple[float, float]] = []
        self.collectives = 0
        self.steps = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())

    def on_train_epoch_start(self) -> None:
        self.stamps.append(now())
        if len(self.stamps) == 2:  # the timed epochs begin: count their collectives
            _counting(True)
            self.steps = self.trainer.global_step

    def on_train_end(self) -> None:
        self.stamps.append(now())
        self.collectives = _counting(False)
        self.steps = self.trainer.global_step - self.steps


def _fit(data: TensorDataset, epochs: int, debug: bool) -> tuple[float, float, float]:
    """One fit; (wall, CPU) seconds per epoch after the first, and the torch.distributed
    collectives per step of those epochs."""
    module = Mlp()
    strategy = DDPStrategy(debug=debug)
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(
        data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    trainer.fit(module, loader)
    assert isinstance(strategy.collective, DebugCollective) == debug, strategy.collective
    stamps = module.stamps
    timed = len(stamps) - 2
    return (
        (stamps[-1][0] - stamps[1][0]) / timed,
        (stamps[-1][1] - stamps[1][1]) / timed,
        module.collectives / max(module.steps, 1),
    )


def _joined(debug: bool) -> Any:
    """A ddp strategy's collective, joined to the benchmark's process group."""
    strategy = DDPStrategy(debug=debug)
    strategy.collective.setup()
    assert isinstance(strategy.collective, DebugCollective) == debug, strategy.collective
    return strategy.collective


def _scalar_call(collective: Any) -> Callable[[], object]:
    tensor = torch.tensor(1.0)
    return lambda: collective.all_reduce(tensor, "sum")


def _rank_worker(
    rank: int, world_size: int, rounds: int, calls: int, fit_rounds: int, epochs: int, samples: int
) -> dict[str, Any]:
    set_threads(1)
    dist.init_process_group("gloo")
    _count_collectives()
    try:
        collectives = {"plain": _joined(False), "debug": _joined(True)}
        per_call: dict[str, float] = {}
        for name, collective in collectives.items():
            _counting(True)
            for _ in range(10):
                collective.all_reduce(torch.tensor(1.0), "sum")
            per_call[name] = _counting(False) / 10
        before = cpu_ticks()
        scalar, cpu = interleave_calls(
            {name: _scalar_call(c) for name, c in collectives.items()}, calls, rounds, dist.barrier
        )
        scalar_steal = steal_percent(before, cpu_ticks())
        data = make_dataset(samples)
        fit_cpu: dict[str, list[float]] = {"plain": [], "debug": []}
        per_step: dict[str, float] = {}

        def contestant(debug: bool) -> Callable[[], float]:
            name = "debug" if debug else "plain"

            def run() -> float:
                wall, used, calls = _fit(data, epochs, debug)
                fit_cpu[name].append(used)
                per_step[name] = calls
                return wall

            return run

        before = cpu_ticks()
        fit = interleave(
            {"plain": contestant(False), "debug": contestant(True)}, fit_rounds, warmup=1
        )
        fit_steal = steal_percent(before, cpu_ticks())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "scalar": scalar,
        "scalar_cpu": {k: v[-rounds:] for k, v in cpu.items()},
        "fit": fit,
        "fit_cpu": {k: v[-fit_rounds:] for k, v in fit_cpu.items()},
        "steal": {"scalar": scalar_steal, "fit": fit_steal},
        "per_call": per_call,
        "per_step": per_step,
    }


def _slower(per_rank: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per round, the slower rank's figure: a collective ends when its last rank does."""
    first, second = per_rank[0][key], per_rank[1][key]
    return {
        name: [max(a, b) for a, b in zip(first[name], second[name], strict=True)] for name in first
    }


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--epochs", type=int, default=None, help="epochs per fit, warm-up included")
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 60)
    fit_rounds = args.rounds or (1 if smoke else 7)
    calls = 2 if smoke else 50
    epochs = args.epochs or (2 if smoke else 5)
    samples = 512 if smoke else 8192
    per_rank = run_distributed(
        _rank_worker,
        2,
        rounds,
        calls,
        fit_rounds,
        epochs,
        samples,
        timeout=900,
        env=TORCHRUN_ENV,
    )
    steal = per_rank[0]["steal"]
    per_call, per_step = per_rank[0]["per_call"], per_rank[0]["per_step"]
    scalar_cpu = per_rank[0]["scalar_cpu"]
    fit_cpu = per_rank[0]["fit_cpu"]
    steps = samples // 2 // BATCH_SIZE
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())

    def cpu_note(values: dict[str, list[float]], unit: str, digits: str) -> str:
        return "CPU per call (process time, rank 0), median: " + ", ".join(
            f"{name} {statistics.median(v):{digits}} {unit}" for name, v in values.items()
        )

    sections = [
        section(
            "debug_scalar",
            "all_reduce of a scalar (sum), debug mode vs plain, 2 ranks, gloo",
            "µs",
            _slower(per_rank, "scalar"),
            threads=THREADS,
            ratios=[("debug", "plain", 1.3)],
            notes=[
                f"µs per call, the median of a round's {calls} calls, the contestants taking "
                f"turns call by call; {rounds} rounds; the slower rank's figure",
                "plain = DDPStrategy().collective (TorchCollective); debug = "
                "DDPStrategy(debug=True).collective (DebugCollective over RecordingCollective)",
                cpu_note(scalar_cpu, "µs", ".3g"),
                "torch.distributed collectives per call: "
                + ", ".join(f"{name} {n:g}" for name, n in per_call.items()),
                f"CPU steal {steal['scalar']} % while this ran; load average after the "
                f"script {load}",
            ],
        ),
        section(
            "debug_fit",
            "Seconds per epoch, 2 ranks, gloo (ddp), debug mode vs plain",
            "s/epoch",
            _slower(per_rank, "fit"),
            threads=THREADS,
            ratios=[("debug", "plain", 1.10)],
            notes=[
                f"{samples} samples, batch {BATCH_SIZE}, {steps} steps per epoch per rank, "
                f"{epochs} epochs per fit (epoch 0 untimed), {fit_rounds} interleaved rounds "
                "after a warm-up round; the slower rank's figure",
                "plain = Trainer(strategy=DDPStrategy()); debug = "
                "Trainer(strategy=DDPStrategy(debug=True)): every gradient bucket (which "
                "carries the step's decision) goes through the checked collective",
                "CPU seconds per epoch (process time, rank 0), median: "
                + ", ".join(f"{name} {statistics.median(v):.3g} s" for name, v in fit_cpu.items()),
                "torch.distributed collectives per step (Python calls, timed epochs): "
                + ", ".join(f"{name} {n:.2f}" for name, n in per_step.items())
                + "; plain's gradient all-reduce runs in DDP's C++ reducer (one bucket per "
                "step here) and is not among them",
                f"CPU steal {steal['fit']} % while the fits ran",
            ],
        ),
    ]
    emit("bench_debug", sections, args.json)


if __name__ == "__main__":
    main()
