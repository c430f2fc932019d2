"""`ParallelStrategy`: the shared base of strategies that run one process per device.

Which launcher starts a node's ranks depends on the start method (re-run the script, or a
`multiprocessing` method); the launchers themselves live above the core, in
`accord.launchers`, which registers one per start method in `START_METHOD_LAUNCHERS` when it
is imported (``import accord`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.strategy import Strategy
from accord.core.timeouts import DEFAULT_TIMEOUT
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision

if TYPE_CHECKING:
    from accord.launchers.launcher import Launcher

__all__ = ["START_METHOD_LAUNCHERS", "LauncherFactory", "ParallelStrategy", "StartMethod"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
"""How accord starts the local ranks: re-run the script (``popen``) or a multiprocessing method."""

LauncherFactory = Callable[[ClusterEnvironment, int, int, str], "Launcher"]
"""Builds a start method's launcher from the cluster environment, the processes per node,
the number of nodes and the start method."""

START_METHOD_LAUNCHERS: dict[str, LauncherFactory] = {}
"""The launcher of each start method, registered by `accord.launchers`."""


class ParallelStrategy(Strategy):
    """One process per device on ``num_nodes`` machines.

    Args:
        parallel_devices: this node's devices, one per process (the Trainer fills it in).
        num_nodes: how many machines take part.
        start_method: how accord starts the local ranks when nothing else did (torchrun,
            SLURM): ``"popen"`` re-runs the script once per rank; ``"spawn"``, ``"fork"`` and
            ``"forkserver"`` start them with `multiprocessing`. Strategies whose engine
            starts its own processes ignore it.
        process_group_backend: the torch.distributed backend of the default collective
            (``"gloo"``, ``"nccl"``, ...; default: the engine's choice for the device), for
            the strategies whose collective runs on a process group (DDP, FSDP, DeepSpeed).
        timeout: seconds (or a timedelta) a collective op may wait for the other ranks
            (default: `accord.core.timeouts.DEFAULT_TIMEOUT`, 30 minutes).
        accelerator, collective, cluster_environment, precision, debug: as `Strategy`.

    Raises:
        ConfigurationError: ``start_method`` is not one of those four.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        debug: bool = False,
    ) -> None:
        super().__init__(
            accelerator,
            collective=collective,
            cluster_environment=cluster_environment,
            precision=precision,
            debug=debug,
        )
        if start_method not in get_args(StartMethod):
            raise ConfigurationError(
                f"start_method={start_method!r} is not one of "
                f"{', '.join(repr(m) for m in get_args(StartMethod))}."
            )
        self.parallel_devices = parallel_devices
        self.num_nodes = num_nodes
        self.start_method: StartMethod = start_method
        self.process_group_backend = process_group_backend
        self.timeout = timeout

    @override
    def configure_devices(
        self, devices: list[torch.device], num_nodes: int, environment: ClusterEnvironment
    ) -> None:
        """One process per device on each of ``num_nodes`` machines; refuse a job the
        cluster environment cannot form (`validate_cluster`), then set the ranks.

        Raises:
            ConfigurationError: the cluster environment cannot form this job.
        """
        super().configure_devices(devices, num_nodes, environment)
        self.validate_cluster(len(devices), num_nodes)
        if self.parallel_devices is None:
            self.parallel_devices = devices
        self.num_nodes = num_nodes
        self.configure_ranks()

    @override
    def configure_launcher(self) -> None:
        env = self.cluster_environment
        if env is None or env.creates_processes_externally:
            self._launcher = None
            return
        factory = START_METHOD_LAUNCHERS.get(self.start_method)
        if factory is None:
            raise ConfigurationError(
                f"No launcher is registered for start_method={self.start_method!r}: import "
                "accord.launchers (import accord does) before configuring the strategy."
            )
        self._launcher = factory(env, self.num_processes, self.num_nodes, self.start_method)

    @property
    def launches_own_processes(self) -> bool:
        """Whether this strategy's launcher starts the local ranks from the calling process.

        True for the ``spawn``, ``fork`` and ``forkserver`` start methods (and XLA's
        ``xmp.spawn``): the caller runs the Trainer and its launcher starts the ranks. False
        for ``popen``, whose ranks may equally be started by torchrun or `run_distributed`.
        """
        return self.start_method != "popen"

    def external_launch_command(self, num_processes: int) -> list[str] | None:
        """The command that must start ``num_processes`` ranks of this strategy on this machine.

        ``None`` (the default) when accord can start them itself. A strategy whose ranks only
        an outside launcher can start (Horovod: ``horovodrun``) returns that launcher's
        command, to be followed by ``python ...``; `accord.testing.assert_strategies_agree`
        runs its ranks under it.
        """
        return None

    @override
    def check_manual_optimization(self) -> None:
        """Refuse manual optimization; the strategies that run it (DDP) override this.

        Raises:
            ConfigurationError: always, naming the strategies that run it.
        """
        raise ConfigurationError(
            f"Manual optimization (automatic_optimization = False) does not run on "
            f"{type(self).__name__}. Use strategy='ddp' (or 'ddp_spawn', 'ddp_fork') for "
            "several processes, 'single_device' or 'dp' for one, or keep "
            "automatic_optimization = True on this strategy."
        )

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    @override
    def root_device(self) -> torch.device:
        if self._fixed_root_device is not None:
            return self._fixed_root_device
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def validate_cluster(self, num_devices: int, num_nodes: int) -> None:
        """Refuse a job the cluster environment cannot form, before any process starts.

        Strategies whose own launcher forms the group (Horovod) override it.
        """
        if self.cluster_environment is not None:
            self.cluster_environment.validate_settings(num_devices, num_nodes)

    def configure_ranks(self) -> None:
        """Tell the cluster environment the world size and this process's rank."""
        env = self.cluster_environment
        if env is None:
            return
        if self.membership is not None:  # the group went on without lost ranks
            env.set_global_rank(self.membership[0])
            env.set_world_size(self.membership[1])
            return
        env.set_world_size(self.num_nodes * self.num_processes)
        env.set_global_rank(env.node_rank() * self.num_processes + env.local_rank())

    # Set while the process is set up: its local rank no longer changes, and the loop asks
    # for the device on every batch (the cluster environment reads it from os.environ).
    _fixed_root_device: torch.device | None = None

    @override
    def setup_environment(self) -> None:
        self.configure_ranks()
        super().setup_environment()
        self._fixed_root_device = self.root_device

    @override
    def teardown(self) -> None:
        self._fixed_root_device = None
        super().teardown()

    @override
    def evaluation_context(self, inference_mode: bool) -> contextlib.AbstractContextManager[Any]:
        """`torch.no_grad` on a gloo process group, whose collectives do not run on
        inference tensors; else as `Strategy.evaluation_context`."""
        if getattr(self.base_collective, "backend", None) == "gloo":
            return torch.no_grad()
        return super().evaluation_context(inference_mode)

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        env = self.cluster_environment
        if env is None:
            return {}
        return {
            "rank": self.global_rank,
            "world_size": self.world_size,
            "main_address": env.main_address,
            "main_port": env.main_port,
        }
