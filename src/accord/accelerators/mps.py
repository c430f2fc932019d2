"""`MPSAccelerator`: Apple-silicon GPUs through torch.backends.mps."""

from __future__ import annotations

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.errors import ConfigurationError

__all__ = ["MPSAccelerator"]


class MPSAccelerator(Accelerator):
    """The single Apple GPU of a Mac."""

    name = "mps"

    @staticmethod
    @override
    def is_available() -> bool:
        return bool(torch.backends.mps.is_available())

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @override
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        return [torch.device("mps", index) for index in devices]

    @override
    def _check_count(self, count: int) -> list[int]:
        if count > 1:
            raise ConfigurationError(f"MPS has one device; devices={count} cannot work. Use 1.")
        return [0]
