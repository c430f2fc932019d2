"""`CUDAAccelerator`: NVIDIA GPUs through torch.cuda."""

from __future__ import annotations

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.errors import ConfigurationError

__all__ = ["CUDAAccelerator"]


class CUDAAccelerator(Accelerator):
    """CUDA GPUs; one process per device."""

    name = "cuda"

    @staticmethod
    @override
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    @override
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    @override
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", index) for index in devices]

    @override
    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    @override
    def teardown(self) -> None:
        torch.cuda.empty_cache()

    @override
    def _check_count(self, count: int) -> list[int]:
        available = self.auto_device_count()
        if count > available:
            raise ConfigurationError(
                f"Asked for {count} CUDA device(s) but {available} are visible. Lower "
                "devices=, or check CUDA_VISIBLE_DEVICES."
            )
        return list(range(count))
