"""`XLAAccelerator`: TPUs and other XLA devices through torch_xla (optional)."""

from __future__ import annotations

import os

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.env_vars import env_number
from accord.errors import ConfigurationError, MissingDependencyError
from accord.imports import import_problem, require

__all__ = ["XLAAccelerator"]

_FEATURE = "accelerator='xla'"


class XLAAccelerator(Accelerator):
    """XLA devices (TPU, or the CPU runtime with ``PJRT_DEVICE=CPU``).

    Counting devices never starts the XLA runtime: torch_xla can only launch ranks from a
    process where it has not started yet. On the CPU runtime the count is
    ``CPU_NUM_DEVICES`` (default 1), which `XLALauncher` sets for the ranks it starts.
    """

    name = "xla"

    @classmethod
    def checked(cls) -> XLAAccelerator:
        """An instance, or `MissingDependencyError` saying how to install torch_xla."""
        require("torch_xla", _FEATURE)
        reason = import_problem("torch_xla")
        if reason is not None:
            raise MissingDependencyError(
                _FEATURE,
                "torch_xla",
                "xla",
                reason=f"does not import ({reason}; it needs the torch release it was built for)",
            )
        return cls()

    @staticmethod
    @override
    def is_available() -> bool:
        return import_problem("torch_xla") is None

    @staticmethod
    @override
    def auto_device_count() -> int:
        import torch_xla
        import torch_xla.runtime as xr

        if torch_xla._XLAC._xla_runtime_is_initialized():
            return int(xr.global_runtime_device_count())
        if xr.device_type() == "TPU":
            from torch_xla._internal import tpu

            return int(tpu.num_available_devices())
        return env_number("CPU_NUM_DEVICES", int, 1)

    @override
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        return [torch.device("xla", index) for index in devices]

    @override
    def _check_count(self, count: int) -> list[int]:
        runtime = os.environ.get("PJRT_DEVICE", "CPU").split("_")[0].upper()
        if runtime != "CPU" and count > self.auto_device_count():
            raise ConfigurationError(
                f"devices={count} asks for more XLA devices than the {runtime} runtime has "
                f"({self.auto_device_count()}). Pass devices='auto' or a smaller count."
            )
        return list(range(count))
