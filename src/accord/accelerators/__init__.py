"""Accelerators: which devices a strategy runs on."""

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.accelerators.cpu import CPUAccelerator
from accord.accelerators.cuda import CUDAAccelerator
from accord.accelerators.mps import MPSAccelerator
from accord.accelerators.registry import ACCELERATORS, accelerator_from_name, auto_accelerator
from accord.core.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"XLAAccelerator": "accord.engines.xla.accelerator"})

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "DevicesLike",
    "MPSAccelerator",
    "XLAAccelerator",
    "accelerator_from_name",
    "auto_accelerator",
]
