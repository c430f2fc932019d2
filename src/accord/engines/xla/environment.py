"""`XLAEnvironment`: ranks as the XLA runtime (torch_xla.runtime) reports them."""

from __future__ import annotations

import os

from typing_extensions import override

from accord.core.env_vars import env_number
from accord.environments.cluster_environment import ClusterEnvironment
from accord.imports import TORCH_XLA_AVAILABLE, require

__all__ = ["XLAEnvironment"]

_DEFAULT_COORDINATOR_PORT = 8547
"""torch_xla's default ``XLA_COORDINATOR_PORT`` (multi-host runtimes rendezvous there)."""


class XLAEnvironment(ClusterEnvironment):
    """Where this rank sits, from ``torch_xla.runtime`` once the XLA runtime runs.

    torch_xla's launcher (``xmp.spawn``, started by `XLALauncher`) creates the ranks: one
    per device, a process per chip and a thread per device in it. Inside a rank the
    identity is the runtime's: ``global_ordinal()``, ``world_size()``, ``local_ordinal()``
    and ``host_index()``, which are per thread where ranks share a process. Before the
    runtime starts (in the launching process) the environment only holds what the strategy
    computed, because asking the runtime would start it there and torch_xla cannot launch
    ranks after that.

    Raises:
        MissingDependencyError: torch_xla is not installed.
    """

    def __init__(self) -> None:
        require("torch_xla", "XLAEnvironment")
        self._world_size = 1
        self._global_rank = 0

    @staticmethod
    def runtime_started() -> bool:
        """Whether the XLA runtime is running in this process (so ranks are known)."""
        import torch_xla

        return bool(torch_xla._XLAC._xla_runtime_is_initialized())

    @property
    @override
    def creates_processes_externally(self) -> bool:
        # Inside a rank the runtime runs; the launching process has not started it.
        return self.runtime_started()

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return env_number("XLA_COORDINATOR_PORT", int, _DEFAULT_COORDINATOR_PORT)

    @staticmethod
    @override
    def detect() -> bool:
        return bool(TORCH_XLA_AVAILABLE) and "PJRT_DEVICE" in os.environ

    @override
    def world_size(self) -> int:
        if self.runtime_started():
            import torch_xla.runtime as xr

            return int(xr.world_size())
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        if self.runtime_started():
            import torch_xla.runtime as xr

            return int(xr.global_ordinal())
        return self._global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    @override
    def local_rank(self) -> int:
        if self.runtime_started():
            import torch_xla.runtime as xr

            return int(xr.local_ordinal())
        return 0

    @override
    def node_rank(self) -> int:
        if self.runtime_started():
            import torch_xla.runtime as xr

            return int(xr.host_index())
        return 0
