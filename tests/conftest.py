"""Shared test settings; the shared helpers are in `tests.helpers`."""

from __future__ import annotations

import os

import torch

torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
