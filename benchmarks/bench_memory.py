"""Peak resident memory (RSS) of the fit benchmarks: raw loop, accord and Lightning.

Every sample is a fresh process (a fresh pair of rank processes for ``--ranks 2``), so no
contestant inherits memory another one allocated or left in the allocator. Each process
imports the same modules (torch, accord and this benchmark; Lightning's contestant also
imports ``pytorch_lightning`` before its fit), builds the data, reads its RSS, runs the
same fit as ``bench_fit.py`` and reads its peak RSS (``VmHWM`` in ``/proc/self/status``).
Reported: the process's peak, the slower rank's for two ranks, and what the fit added
above the RSS it started from.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch.distributed as dist
from bench_fit import FITS
from common import TORCHRUN_ENV, emit, make_dataset, parser, peers, section, set_threads

from accord.testing import run_distributed

_MIB = 1024.0


def _status_kib(field: str) -> float:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _fit_memory(rank: int, world_size: int, name: str, epochs: int, samples: int) -> list[float]:
    """Run one contestant's fit in this fresh rank process; return (start, peak) RSS, MiB."""
    set_threads(1)
    if name == "lightning":
        import pytorch_lightning  # noqa: F401  (its import is not the fit's memory)
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        data = make_dataset(samples)
        start = _status_kib("VmRSS")
        FITS[name](data, epochs, world_size)
        return [start / _MIB, _status_kib("VmHWM") / _MIB]
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def measure(
    names: list[str], rounds: int, ranks: int, epochs: int, samples: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each round runs every contestant once in new processes, alternating the order.

    Returns the peak RSS and the fit's increment (MiB) per contestant, one value per round
    (the larger of the two ranks for ``ranks=2``).
    """
    peak: dict[str, list[float]] = {name: [] for name in names}
    added: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            per_rank = run_distributed(
                _fit_memory, ranks, name, epochs, samples, timeout=600, env=TORCHRUN_ENV
            )
            peak[name].append(max(p for _, p in per_rank))
            added[name].append(max(p - s for s, p in per_rank))
    return peak, added


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 3)
    epochs = 2 if smoke else 5
    samples = 512 if smoke else 8192
    taking_part, skipped = peers(smoke, "pytorch_lightning")
    names = ["raw", "accord"] + (["lightning"] if taking_part else [])
    skipped = {"lightning" if k == "pytorch_lightning" else k: v for k, v in skipped.items()}
    peak, added = measure(names, rounds, args.ranks, epochs, samples)
    where = "single device (CPU)" if args.ranks == 1 else "2 ranks, gloo (ddp)"
    sec = section(
        f"memory_{args.ranks}",
        f"Peak RSS of a fit, {where}",
        "MiB",
        peak,
        threads=(
            "1 process, torch.set_num_threads(1)"
            if args.ranks == 1
            else "2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1"
        ),
        ratios=[("accord", "raw", 1.02)],
        skipped=skipped,
        notes=[
            f"the fit of bench_fit.py ({samples} samples, {epochs} epochs) in a new process "
            f"per sample{'; the larger rank' if args.ranks > 1 else ''}, {rounds} rounds; "
            "every process imports torch, accord and the benchmark before it starts",
            "added by the fit (peak minus RSS before it), median: "
            + ", ".join(f"{n} {statistics.median(v):.1f} MiB" for n, v in added.items()),
        ],
        extra={"added_mib": added},
    )
    emit("bench_memory", [sec], args.json)


if __name__ == "__main__":
    main()
