"""Shared test settings; the shared helpers are in `tests.helpers`."""

from __future__ import annotations

import os

import torch

from accord.testing import set_start_method
from tests.helpers.processes import RANK_PRELOAD

torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))

# Test ranks (run_distributed, the conformance suite, assert_strategies_agree) fork from a
# server that imported torch, accord and the test helpers once, instead of importing them
# again in each rank. Tests of accord's launchers start their processes as users do.
set_start_method("forkserver", preload=RANK_PRELOAD)
