"""The collective conformance suite on `HorovodCollective`, one rank per process.

``run_conformance`` starts its own processes, but Horovod's processes are started by
``horovodrun``; so horovodrun runs this script, and each process runs the suite's checks
in-process on its own rank (`run_checks_in_this_process`)::

    horovodrun --gloo -np 2 -H localhost:2 python horovod_conformance.py OUT
    python horovod_conformance.py OUT          # a Horovod group of one

Usage: horovod_conformance.py OUT_DIR [CHECK ...] (default: every check). Each rank writes
``OUT_DIR/rank<rank>.json``, the list of its violations, prints them, and exits 1 if
there are any.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from accord.engines.horovod.collective import HorovodCollective
from accord.testing import run_checks_in_this_process


def main() -> int:
    """Run the checks named on the command line on this rank; 0 when none was violated."""
    out, checks = Path(sys.argv[1]), sys.argv[2:] or None
    # What horovodrun assigned this process; a plain `python` run is a group of one.
    rank = int(os.environ.get("HOROVOD_RANK", 0))
    world_size = int(os.environ.get("HOROVOD_SIZE", 1))
    torch.set_num_threads(1)
    violations = run_checks_in_this_process(
        HorovodCollective, checks, rank=rank, world_size=world_size
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps([dataclasses.asdict(v) for v in violations], indent=1)
    )
    for violation in violations:
        print(violation, file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
