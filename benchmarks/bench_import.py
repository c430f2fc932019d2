"""Import time of a framework on top of torch: ``import X`` after ``import torch``.

Each sample is a fresh ``python -c`` process that imports torch, then the framework, and
reports both durations; the frameworks take turns (A B C A B C ...).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from common import emit, interleave, parser, peers, section

_PROBE = """
import json, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
import {module}
end = time.perf_counter()
print(json.dumps([middle - start, end - middle]))
"""


def import_once(module: str, torch_times: list[float]) -> float:
    """Seconds ``import module`` takes in a fresh process that has already imported torch."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    torch_seconds, module_seconds = json.loads(out.strip().splitlines()[-1])
    torch_times.append(torch_seconds)
    return float(module_seconds)


def main() -> None:
    args = parser(__doc__).parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 10)
    taking_part, skipped = peers(smoke, "pytorch_lightning", "accelerate")
    modules = ["accord", *taking_part]
    torch_times: list[float] = []
    samples = interleave(
        {m: (lambda m=m: import_once(m, torch_times)) for m in modules},
        rounds,
        warmup=0 if smoke else 1,
    )
    torch_times = torch_times[-rounds * len(modules) :]
    torch_median = statistics.median(torch_times)
    accord_median = statistics.median(samples["accord"])
    sec = section(
        "import",
        "import X after import torch (fresh processes)",
        "s",
        samples,
        threads="default (import only)",
        skipped=skipped,
        notes=[
            f"median of {rounds} fresh processes per module after a warm-up round; "
            f"import torch itself: median {torch_median:.3f} s"
        ],
        extra={
            "torch_import_s": torch_times,
            "goal_rows": [
                {
                    "name": "import accord - import torch",
                    "measured": f"{accord_median:.3f} s",
                    "goal": "≤ 0.3 s",
                    "met": accord_median <= 0.3,
                }
            ],
        },
    )
    emit("bench_import", [sec], args.json)


if __name__ == "__main__":
    main()
