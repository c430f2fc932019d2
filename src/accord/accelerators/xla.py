"""`XLAAccelerator`: TPUs and other XLA devices through torch_xla (optional)."""

from __future__ import annotations

import torch
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.errors import MissingDependencyError

__all__ = ["XLAAccelerator"]

_XLA_AVAILABLE = RequirementCache("torch_xla")


class XLAAccelerator(Accelerator):
    """XLA devices (TPU, or the CPU runtime with ``PJRT_DEVICE=CPU``)."""

    name = "xla"

    @classmethod
    def checked(cls) -> XLAAccelerator:
        """An instance, or `MissingDependencyError` saying how to install torch_xla."""
        if not _XLA_AVAILABLE:
            raise MissingDependencyError("accelerator='xla'", "torch_xla", "xla")
        return cls()

    @staticmethod
    @override
    def is_available() -> bool:
        return bool(_XLA_AVAILABLE)

    @staticmethod
    @override
    def auto_device_count() -> int:
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count())

    @override
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        return [torch.device("xla", index) for index in devices]
