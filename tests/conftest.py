"""Shared test settings; the shared helpers are in `tests.helpers`."""

from __future__ import annotations

import os

import torch

from accord.testing import set_start_method
from tests.helpers.processes import RANK_PRELOAD

# Each pytest process gets its share of the cores: half of them without pytest-xdist, one
# worker's share under it (`make unit` runs one worker per core). Under xdist the processes
# a test starts get that share too, through OMP_NUM_THREADS (a launcher's default yields to
# it), so that two workers' jobs do not ask for twice the cores there are.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, (os.cpu_count() or 1) // max(2, _WORKERS))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# Test ranks (run_distributed, the conformance suite, assert_strategies_agree) fork from a
# server that imported torch, accord and the test helpers once, instead of importing them
# again in each rank. Tests of accord's launchers start their processes as users do.
set_start_method("forkserver", preload=RANK_PRELOAD)
