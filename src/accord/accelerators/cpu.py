"""`CPUAccelerator`: processes on the host CPU."""

from __future__ import annotations

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator

__all__ = ["CPUAccelerator"]


class CPUAccelerator(Accelerator):
    """The CPU. ``devices=N`` means N processes (not cores); ``"auto"`` means one."""

    name = "cpu"

    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @override
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        return [torch.device("cpu")] * len(devices)
