"""`seed_everything`: one call seeds Python, NumPy (when installed) and torch."""

from __future__ import annotations

import os
import random

import torch

from accord.imports import NUMPY_AVAILABLE

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> int:
    """Seed every random number generator accord's users rely on; return ``seed``.

    The seed is also exported as ``ACCORD_SEED`` so processes started later can read it.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**32).")
    os.environ["ACCORD_SEED"] = str(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    if NUMPY_AVAILABLE:
        import numpy

        numpy.random.seed(seed)
    return seed
