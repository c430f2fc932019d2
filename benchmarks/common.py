"""What every benchmark script shares: the work, the statistics, the output format.

The work is fixed here once, so every contestant trains the same model on the same data
with the same batch size and optimizer: a small MLP regressing a generated dataset.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# The work: one definition for every contestant.
FEATURES = 32
HIDDEN = 128
SAMPLES = 8192
BATCH_SIZE = 64
LR = 0.01
MOMENTUM = 0.9
SEED = 0

# Environment that makes accord and Lightning both see a torchrun-started process, so they
# join the process group the benchmark created instead of launching processes of their own.
TORCHRUN_ENV = {"GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "accord-bench", "OMP_NUM_THREADS": "1"}

SMOKE_SKIP = "--smoke runs the raw and accord contestants only"

GROUP_METHODS = {"allreduce": "all_reduce", "all_gather_single": "all_gather_single"}
"""Process group methods a framework may call directly, as torch.distributed's functions of
these names do after their checks (accord's synchronous all_reduce and all_gather do): a
collective counter wraps them too, counting outermost calls, so either way is counted once."""


def wrap_group_methods(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each of `GROUP_METHODS` on ``torch.distributed.ProcessGroup`` with
    ``wrap(collective name, method)``."""
    import torch.distributed as dist

    for method, name in GROUP_METHODS.items():
        original = getattr(dist.ProcessGroup, method, None)
        if original is not None:
            setattr(dist.ProcessGroup, method, wrap(name, original))


def make_net() -> nn.Module:
    """The benchmark MLP: FEATURES -> HIDDEN -> HIDDEN -> 1, tanh activations."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    """The benchmark optimizer: SGD with momentum."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def make_dataset(samples: int = SAMPLES) -> TensorDataset:
    """A fixed regression dataset: y = sin(2 x.w) + noise (identical on every rank)."""
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(samples, FEATURES, generator=generator)
    w = torch.randn(FEATURES, generator=generator) / FEATURES**0.5
    y = torch.sin(2 * x @ w) + 0.05 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y)


def loss_fn(net: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``net`` on one ``(x, y)`` batch."""
    x, y = batch
    return nn.functional.mse_loss(net(x).squeeze(-1), y)


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time), in seconds."""
    return time.perf_counter(), time.process_time()


def set_threads(threads: int) -> dict[str, Any]:
    """Pin this process's intra-op threads; return what is in force, for the report."""
    torch.set_num_threads(threads)
    return {
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def unavailable(module: str) -> str | None:
    """Why ``module`` cannot be a contestant here, or None when it can be imported."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed in {sys.prefix} (make bench installs it)"
    return None


def peers(smoke: bool, *modules: str) -> tuple[list[str], dict[str, str]]:
    """The peer frameworks that take part, and the reason each other one is skipped."""
    taking_part: list[str] = []
    skipped: dict[str, str] = {}
    for module in modules:
        reason = SMOKE_SKIP if smoke else unavailable(module)
        if reason is None:
            taking_part.append(module)
        else:
            skipped[module] = reason
    return taking_part, skipped


def interleave(
    contestants: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run the contestants in turn, ``warmup`` unrecorded rounds first.

    Rounds alternate direction (A B C, C B A, A B C, ...), so no contestant always runs
    right after the same other one, and a slow drift in the machine's load weighs on all of
    them alike. Garbage left by one contestant is collected before the next one starts;
    what exists before the first round (modules, the data) is frozen out of the collector,
    so that collection is quick.
    """
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    order = list(contestants)
    gc.collect()
    gc.freeze()
    for index in range(warmup + rounds):
        for name in order if index % 2 == 0 else order[::-1]:
            gc.collect()
            value = contestants[name]()
            if index >= warmup:
                samples[name].append(value)
    return samples


def interleave_calls(
    contestants: Mapping[str, Callable[[], object]],
    calls: int,
    rounds: int,
    sync: Callable[[], object],
    warmup: int = 1,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Latency rounds in which the contestants take turns call by call.

    A round is ``calls`` turns; in each turn every contestant makes one call, the order
    rotating from turn to turn, so each one follows each other one equally often. A
    round's sample for a contestant is the median of its calls (µs of wall and of CPU
    time), taken between calls made microseconds apart: a change in how the machine
    schedules the processes (on a shared host small collectives run now at one speed, now
    at several times it, for whole blocks of calls) reaches every contestant of the round
    alike, and a single call stretched by a stall does not move the round's figure.
    ``sync`` (a barrier between ranks) starts each round; no collection runs inside one.
    Returns (wall, CPU) samples per contestant, ``warmup`` unrecorded rounds first.
    """
    names = list(contestants)
    orders = [names[k:] + names[:k] for k in range(len(names))]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.freeze()
    for index in range(warmup + rounds):
        spent: dict[str, list[float]] = {name: [] for name in names}
        used: dict[str, list[float]] = {name: [] for name in names}
        sync()
        gc.disable()
        for turn in range(calls):
            for name in orders[turn % len(orders)]:
                start, start_cpu = time.perf_counter(), time.process_time()
                contestants[name]()
                end_cpu, end = time.process_time(), time.perf_counter()
                spent[name].append(end - start)
                used[name].append(end_cpu - start_cpu)
        gc.enable()
        gc.collect()
        if index >= warmup:
            for name in names:
                wall[name].append(statistics.median(spent[name]) * 1e6)
                cpu[name].append(statistics.median(used[name]) * 1e6)
    return wall, cpu


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's informational logging and its advice warnings while timing."""
    import logging
    import warnings

    names = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


@dataclass
class Summary:
    """Median and spread of one contestant's samples."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        """Summarise ``samples`` (at least one)."""
        ordered = sorted(samples)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))


def section(
    key: str,
    title: str,
    unit: str,
    samples: Mapping[str, Sequence[float]],
    *,
    threads: str,
    ratios: Sequence[tuple[str, str, float | None] | tuple[str, str, float | None, str]] = (),
    skipped: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One result table: a row per contestant and the ratios ``(numerator, denominator, goal)``.

    A ratio is the ratio of the medians; its spread is the IQR of the per-round ratios, which
    pairs the samples taken side by side in the same round. A fourth element ``"paired"``
    judges the goal on the median of those per-round ratios instead.
    """
    rows = []
    for name, values in samples.items():
        summary = Summary.of(values)
        rows.append({"contestant": name, **summary.__dict__, "samples": list(values)})
    ratio_rows = []
    for num, den, goal, *judge in ratios:
        if num not in samples or den not in samples:
            continue
        top, bottom = samples[num], samples[den]
        value = statistics.median(top) / statistics.median(bottom)
        paired = Summary.of([a / b for a, b in zip(top, bottom, strict=True)])
        ratio_rows.append(
            {
                "name": f"{num} / {den}",
                "value": value,
                "paired_median": paired.median,
                "paired_q1": paired.q1,
                "paired_q3": paired.q3,
                "goal": goal,
                "judged_on": "paired median" if judge == ["paired"] else "ratio of medians",
                "met": None
                if goal is None
                else (paired.median if judge == ["paired"] else value) <= goal,
            }
        )
    return {
        "key": key,
        "title": title,
        "unit": unit,
        "threads": threads,
        "rows": rows,
        "ratios": ratio_rows,
        "skipped": dict(skipped or {}),
        "notes": list(notes),
        **(dict(extra) if extra else {}),
    }


def machine() -> dict[str, Any]:
    """Facts about the machine and software the numbers were taken on."""
    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    for name in ("pytorch_lightning", "accelerate"):
        try:
            from importlib.metadata import version

            facts[name] = version(name.replace("_", "-"))
        except Exception:
            facts[name] = None
    return facts


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks of the whole machine since boot, from ``/proc/stat``.

    Steal is the time the hypervisor ran something else while this machine's CPUs had
    work; on a shared host it slows every contestant unevenly, so reports state it.
    None where ``/proc/stat`` does not exist (not Linux).
    """
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest is in user.
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two `cpu_ticks` readings, in percent."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100.0 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def parser(description: str | None) -> argparse.ArgumentParser:
    """The options every benchmark script takes."""
    parse = argparse.ArgumentParser(description=description)
    parse.add_argument("--smoke", action="store_true", help="one tiny round, raw and accord only")
    parse.add_argument("--rounds", type=int, default=None, help="recorded rounds per contestant")
    parse.add_argument("--json", type=Path, default=None, help="write the result here")
    return parse


def emit(script: str, sections: Sequence[dict[str, Any]], path: Path | None) -> None:
    """Print ``sections`` as Markdown and write them (with the machine facts) as JSON."""
    payload = {"script": script, "machine": machine(), "sections": list(sections)}
    print(markdown(payload["sections"]))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")


def _number(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f}"
    if unit in ("ms", "µs", "s/epoch", "ms/step"):
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return f"{value:.4g}"


def markdown(sections: Sequence[dict[str, Any]]) -> str:
    """The result tables, then one table of every goal, in Markdown."""
    lines: list[str] = []
    goals: list[str] = []
    for sec in sections:
        unit = sec["unit"]
        lines += [
            f"### {sec['title']}",
            "",
            f"threads: {sec['threads']}",
            "",
            f"| contestant | median ({unit}) | IQR (q1 - q3) | min - max | n |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in sec["rows"]:
            lines.append(
                f"| {row['contestant']} | {_number(row['median'], unit)} | "
                f"{_number(row['q1'], unit)} - {_number(row['q3'], unit)} | "
                f"{_number(row['min'], unit)} - {_number(row['max'], unit)} | {row['n']} |"
            )
        for name, reason in sec["skipped"].items():
            lines.append(f"| {name} | skipped: {reason} | | | |")
        lines.append("")
        for ratio in sec["ratios"]:
            goal = ratio["goal"]
            verdict = "" if goal is None else (" met" if ratio["met"] else " **missed**")
            paired = ratio["judged_on"] == "paired median"
            on = ", on the per-round median" if paired else ""
            target = "" if goal is None else f" (goal ≤ {goal:g}{on}:{verdict})"
            lines.append(
                f"- {ratio['name']}: **{ratio['value']:.3f}**, per-round median "
                f"{ratio['paired_median']:.3f}, IQR "
                f"{ratio['paired_q1']:.3f} - {ratio['paired_q3']:.3f}{target}"
            )
            if goal is not None:
                shown = ratio["paired_median"] if paired else ratio["value"]
                name = ratio["name"] + (" (per-round median)" if paired else "")
                goals.append(
                    f"| {sec['title']} | {name} | {shown:.3f} | ≤ {goal:g} | "
                    f"{'yes' if ratio['met'] else 'no'} |"
                )
        for goal_row in sec.get("goal_rows", []):
            goals.append(
                f"| {sec['title']} | {goal_row['name']} | {goal_row['measured']} | "
                f"{goal_row['goal']} | {'yes' if goal_row['met'] else 'no'} |"
            )
        for note in sec["notes"]:
            lines.append(f"- {note}")
        lines.append("")
    if goals:
        lines += [
            "### Goals",
            "",
            "| benchmark | figure | measured | goal | met |",
            "|---|---|---:|---:|---|",
            *goals,
            "",
        ]
    return "\n".join(lines)
