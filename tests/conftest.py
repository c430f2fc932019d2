"""Shared test settings: keep each test process to its share of the machine's cores."""

import os

import torch

torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
