"""Run every benchmark, print one Markdown report, write ``results/latest.json``.

Each benchmark script runs in its own process (so no process group, thread setting or
import outlives it) with ``OMP_NUM_THREADS=1``; ``make bench`` calls this.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, RESULTS, cpu_ticks, machine, markdown, steal_percent

SCRIPTS: list[tuple[str, list[str]]] = [
    ("bench_import.py", []),
    ("bench_fit.py", ["--ranks", "1"]),
    ("bench_fit.py", ["--ranks", "2"]),
    ("bench_memory.py", ["--ranks", "1"]),
    ("bench_memory.py", ["--ranks", "2"]),
    ("bench_grad_sync.py", []),
    ("bench_reduce.py", []),
    ("bench_logging.py", []),
    ("bench_startup.py", []),
    ("bench_timeline.py", []),
    ("bench_debug.py", []),
    ("bench_checkpoint.py", []),
    ("bench_calls.py", []),
]


def main() -> None:
    parse = argparse.ArgumentParser(description=__doc__)
    parse.add_argument("--smoke", action="store_true", help="pass --smoke to every script")
    parse.add_argument("--json", type=Path, default=RESULTS / "latest.json")
    parse.add_argument("--markdown", type=Path, default=RESULTS / "latest.md")
    args = parse.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    sections = []
    timings = {}
    steal: dict[str, float | None] = {}
    started, first_ticks = time.monotonic(), cpu_ticks()
    with tempfile.TemporaryDirectory() as scratch:
        for index, (script, extra) in enumerate(SCRIPTS):
            out = Path(scratch) / f"{index}.json"
            command = [sys.executable, str(HERE / script), *extra, "--json", str(out)]
            if args.smoke:
                command.append("--smoke")
            label = " ".join([script, *extra])
            print(f"== {label}", flush=True)
            begin, ticks = time.monotonic(), cpu_ticks()
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            timings[label] = round(time.monotonic() - begin, 1)
            steal[label] = steal_percent(ticks, cpu_ticks())
            print(f"   {timings[label]:.1f} s, {_steal(steal[label])}", flush=True)
            for sec in json.loads(out.read_text())["sections"]:
                sec["notes"].append(f"{_steal(steal[label])} while this script ran")
                sections.append(sec)
    facts = machine()
    facts["bench_seconds"] = {**timings, "total": round(time.monotonic() - started, 1)}
    facts["cpu_steal_percent"] = {**steal, "total": steal_percent(first_ticks, cpu_ticks())}
    report = markdown(sections)
    header = (
        f"Run {facts['date']} on {facts['cpu_count']} cores ({facts['platform']}), Python "
        f"{facts['python']}, torch {facts['torch']}, pytorch_lightning "
        f"{facts['pytorch_lightning']}, accelerate {facts['accelerate']}; load average at "
        f"the end {', '.join(f'{x:.1f}' for x in facts['load_average'] or ())}; "
        f"{facts['bench_seconds']['total']:.0f} s in all; "
        f"{_steal(facts['cpu_steal_percent']['total'])}."
    )
    print("\n" + header + "\n\n" + report)
    if not args.smoke:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": facts, "sections": sections}, indent=2) + "\n")
        args.markdown.write_text(header + "\n\n" + report)
        print(f"wrote {args.json} and {args.markdown}")


def _steal(percent: float | None) -> str:
    if percent is None:
        return "CPU steal not measured (no /proc/stat)"
    return f"CPU steal {percent:.1f} %"


if __name__ == "__main__":
    main()
