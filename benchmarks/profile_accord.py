"""Where accord's time goes, for a benchmark that misses its goal.

``--target reduce`` / ``decision``: accord's per-call cost against the raw equivalent in a
one-rank gloo group (no peer to wait for, so the figure is accord's own work and holds up
on a busy machine), then a cProfile of accord's calls. ``--target fit``: pyinstrument (or
cProfile) over accord's single-device fit. ``--target import``: ``python -X importtime``
of ``import accord`` after ``import torch``, the slowest modules first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import timeit
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import make_dataset, set_threads

from accord.environments.local import find_free_port


def _best_us(fn: Callable[[], object], number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


def _cprofile(fn: Callable[[], object], calls: int, top: int = 18) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def per_call(target: str) -> None:
    """Raw vs accord per call in a one-rank group, then accord's profile."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(find_free_port()),
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        TORCHELASTIC_RUN_ID="accord-profile",
    )
    from accord.trainer.connector import connect

    dist.init_process_group("gloo")
    strategy = connect("ddp", "cpu", 1)
    strategy.setup_environment()
    scalar = torch.tensor(1.0)

    def raw_reduce() -> torch.Tensor:
        out = scalar.clone()
        dist.all_reduce(out)
        return out.div_(1)

    def raw_decision() -> bool:
        vote = torch.tensor([1], dtype=torch.int32)
        dist.all_reduce(vote)
        return int(vote.item()) == 1

    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "reduce": (raw_reduce, lambda: strategy.reduce(scalar)),
        "decision": (raw_decision, lambda: strategy.reduce_boolean_decision(True)),
    }
    raw, accord_fn = pairs[target]
    # Alternate short timings and keep each side's best: the least disturbed run of each.
    raw_us = accord_us = float("inf")
    for _ in range(25):
        raw_us = min(raw_us, _best_us(raw, 1000))
        accord_us = min(accord_us, _best_us(accord_fn, 1000))
    print(
        f"{target}, best of 25 alternating runs: raw {raw_us:.1f} µs, accord {accord_us:.1f} "
        f"µs per call; accord's extra work {accord_us - raw_us:.1f} µs per call"
    )
    print(_cprofile(accord_fn, 3000))
    dist.destroy_process_group()


def fit() -> None:
    """Profile accord's single-device fit of the benchmark work."""
    from bench_fit import accord_fit

    data = make_dataset()
    accord_fit(data, 2, 1)
    try:
        from pyinstrument import Profiler
    except ImportError:
        print(_cprofile(lambda: accord_fit(data, 3, 1), 1, top=30))
        return
    profiler = Profiler(interval=0.0005)
    profiler.start()
    accord_fit(data, 3, 1)
    profiler.stop()
    print(profiler.output_text(unicode=False, color=False))


def imports(top: int = 25) -> None:
    """The modules ``import accord`` spends the most time in, after torch is loaded."""
    probe = "import torch; import accord"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    seen_torch = False
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, total, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        if not own.isdigit():
            continue
        if seen_torch:
            rows.append((int(total), int(own), name))
        if name == "torch":
            seen_torch = True
    print(f"{'cumulative ms':>14} {'self ms':>8}  module (imported by import accord)")
    for total, own, name in sorted(rows, reverse=True)[:top]:
        print(f"{total / 1000:14.1f} {own / 1000:8.1f}  {name}")


def main() -> None:
    parse = argparse.ArgumentParser(description=__doc__)
    parse.add_argument("--target", choices=("reduce", "decision", "fit", "import"), required=True)
    args = parse.parse_args()
    set_threads(1)
    if args.target in ("reduce", "decision"):
        per_call(args.target)
    elif args.target == "fit":
        fit()
    else:
        imports()


if __name__ == "__main__":
    main()
