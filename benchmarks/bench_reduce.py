"""Latency of ``strategy.reduce`` (a scalar and 1M floats) and ``reduce_boolean_decision``.

Two real processes on gloo. The benchmark creates the process group; each framework's
strategy object joins it, built the way each Trainer builds it (accord's connector with
``strategy="ddp"``, a Lightning ``Trainer(strategy="ddp")``'s strategy, Accelerate's
``PartialState``), as they would under torchrun. Each round starts from a barrier; in it
the contestants take turns call by call (`common.interleave_calls`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import (
    TORCHRUN_ENV,
    emit,
    interleave_calls,
    parser,
    peers,
    quiet_lightning,
    section,
)

import accord  # noqa: F401  (the package under test; imported like a user would)
from accord.testing import run_distributed
from accord.trainer.connector import connect


def _accord_strategy() -> Any:
    strategy = connect("ddp", "cpu", 2)
    strategy.setup_environment()
    return strategy


def _lightning_strategy() -> Any:
    import pytorch_lightning as pl

    with quiet_lightning():
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.strategy.setup_environment()
    return trainer.strategy


def _reduce_contestants(
    tensor: torch.Tensor, names: list[str], strategies: dict[str, Any]
) -> dict[str, Callable[[], object]]:
    world = dist.get_world_size()
    zeros = torch.zeros_like(tensor)

    def raw() -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out.div_(world)

    def raw_in_place() -> torch.Tensor:
        # Zeros stay zeros under repeated in-place sums, so the input never drifts.
        dist.all_reduce(zeros)
        return zeros

    fns: dict[str, Callable[[], object]] = {"raw": raw, "raw in-place (sum only)": raw_in_place}
    fns["accord"] = lambda: strategies["accord"].reduce(tensor)
    if "lightning" in names:
        # Lightning reduces in place; equal inputs on every rank keep the mean unchanged.
        fns["lightning"] = lambda: strategies["lightning"].reduce(tensor)
    if "accelerate" in names:
        from accelerate.utils import reduce

        fns["accelerate"] = lambda: reduce(tensor, reduction="mean")
    return fns


def _decision_contestants(
    names: list[str], strategies: dict[str, Any]
) -> dict[str, Callable[[], object]]:
    world = dist.get_world_size()

    def raw() -> bool:
        vote = torch.tensor([1], dtype=torch.int32)
        dist.all_reduce(vote)
        return int(vote.item()) == world

    fns: dict[str, Callable[[], object]] = {"raw": raw}
    fns["accord"] = lambda: strategies["accord"].reduce_boolean_decision(True)
    if "lightning" in names:
        fns["lightning"] = lambda: strategies["lightning"].reduce_boolean_decision(True)
    return fns


def _rank_worker(
    rank: int, world_size: int, names: list[str], rounds: int, calls: dict[str, int], big: int
) -> dict[str, dict[str, list[float]]]:
    dist.init_process_group("gloo")
    try:
        strategies = {"accord": _accord_strategy()}
        if "lightning" in names:
            strategies["lightning"] = _lightning_strategy()
        if "accelerate" in names:
            from accelerate import PartialState

            state = PartialState(cpu=True)
            assert state.num_processes == world_size, state
        wall: dict[str, dict[str, list[float]]] = {}
        cpu: dict[str, dict[str, list[float]]] = {}
        cases: dict[str, dict[str, Callable[[], object]]] = {
            "scalar": _reduce_contestants(torch.tensor(1.0), names, strategies),
            "1M": _reduce_contestants(torch.ones(big), names, strategies),
            "decision": _decision_contestants(names, strategies),
        }
        for key, contestants in cases.items():
            wall[key], cpu[key] = interleave_calls(contestants, calls[key], rounds, dist.barrier)
        dist.barrier()
        return {"wall": wall, "cpu": cpu}
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = parser(__doc__).parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 60)
    calls = {"scalar": 50, "1M": 5, "decision": 50}
    if smoke:
        calls = dict.fromkeys(calls, 2)
    big = 1 << 20
    taking_part, skipped = peers(smoke, "pytorch_lightning", "accelerate")
    names = ["raw", "accord"] + [
        {"pytorch_lightning": "lightning", "accelerate": "accelerate"}[m] for m in taking_part
    ]
    skipped = {
        {"pytorch_lightning": "lightning"}.get(name, name): reason
        for name, reason in skipped.items()
    }
    per_rank = run_distributed(
        _rank_worker, 2, names, rounds, calls, big, timeout=600, env=TORCHRUN_ENV
    )
    walls = [result["wall"] for result in per_rank]
    merged = {
        key: {
            name: [max(a, b) for a, b in zip(values, walls[1][key][name], strict=True)]
            for name, values in walls[0][key].items()
        }
        for key in walls[0]
    }
    cpu = per_rank[0]["cpu"]

    def cpu_note(key: str) -> str:
        return "CPU per call (process time, rank 0), median: " + ", ".join(
            f"{name} {statistics.median(values):.3g} µs" for name, values in cpu[key].items()
        )

    threads = "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"
    note = (
        "µs per call, the median of a round's {calls} calls, the contestants taking turns "
        "call by call (the order rotating); {rounds} rounds; the slower rank's figure"
    )
    raw_note = (
        "raw = clone + dist.all_reduce(SUM) + div_ (the non-mutating mean that accord and "
        "Accelerate return); raw in-place = dist.all_reduce alone (info)"
    )
    reduce_skips = dict(skipped)
    decision_skips = {k: v for k, v in skipped.items() if k != "accelerate"}
    sections = [
        section(
            "reduce_scalar",
            "strategy.reduce latency, scalar (mean), 2 ranks, gloo",
            "µs",
            merged["scalar"],
            threads=threads,
            ratios=[("accord", "raw", 1.10), ("accord", "lightning", 0.6)],
            skipped=reduce_skips,
            notes=[note.format(calls=calls["scalar"], rounds=rounds), raw_note, cpu_note("scalar")],
            extra={"cpu_us": cpu["scalar"]},
        ),
        section(
            "reduce_1m",
            f"strategy.reduce latency, {big} float32 (mean), 2 ranks, gloo",
            "µs",
            merged["1M"],
            threads=threads,
            ratios=[("accord", "raw", 1.05), ("accord", "lightning", 0.6)],
            skipped=reduce_skips,
            notes=[note.format(calls=calls["1M"], rounds=rounds), raw_note, cpu_note("1M")],
            extra={"cpu_us": cpu["1M"]},
        ),
        section(
            "decision",
            "reduce_boolean_decision latency, 2 ranks, gloo",
            "µs",
            merged["decision"],
            threads=threads,
            ratios=[("accord", "raw", 1.10, "paired"), ("accord", "lightning", None)],
            skipped=decision_skips,
            notes=[
                note.format(calls=calls["decision"], rounds=rounds),
                "raw = one int32 dist.all_reduce(SUM) and .item()",
                cpu_note("decision"),
            ],
            extra={"cpu_us": cpu["decision"]},
        ),
    ]
    emit("bench_reduce", sections, args.json)


if __name__ == "__main__":
    main()
