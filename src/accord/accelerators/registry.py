"""Accelerator names → classes, and ``accelerator="auto"`` detection."""

from __future__ import annotations

from accord.accelerators.accelerator import Accelerator
from accord.accelerators.cpu import CPUAccelerator
from accord.accelerators.cuda import CUDAAccelerator
from accord.accelerators.mps import MPSAccelerator
from accord.errors import ConfigurationError, did_you_mean

__all__ = ["ACCELERATORS", "accelerator_from_name", "auto_accelerator"]

ACCELERATORS: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "gpu": CUDAAccelerator,
    "mps": MPSAccelerator,
}
"""Names accepted by ``Trainer(accelerator=...)`` (``"gpu"`` is CUDA, else MPS)."""


def auto_accelerator() -> Accelerator:
    """The best accelerator present: CUDA, then MPS, then CPU."""
    for cls in (CUDAAccelerator, MPSAccelerator):
        if cls.is_available():
            return cls()
    return CPUAccelerator()


def accelerator_from_name(name: str) -> Accelerator:
    """Build the accelerator called ``name`` (``"auto"`` detects), or explain the mistake."""
    key = name.strip().lower()
    if key == "auto":
        return auto_accelerator()
    if key == "xla" or key == "tpu":
        from accord.engines.xla.accelerator import XLAAccelerator

        return XLAAccelerator.checked()
    if key == "gpu" and not CUDAAccelerator.is_available() and MPSAccelerator.is_available():
        return MPSAccelerator()
    cls = ACCELERATORS.get(key)
    if cls is None:
        names = [*ACCELERATORS, "xla", "auto"]
        raise ConfigurationError(
            f"Unknown accelerator {name!r}.{did_you_mean(key, names)} Choose one of {names}."
        )
    if not cls.is_available():
        raise ConfigurationError(
            f"accelerator={name!r} was requested but no {cls.name.upper()} device is available "
            "in this process. Use accelerator='cpu' or 'auto', or run on a machine that has one."
        )
    return cls()
