"""`Strategy`: how a model trains across devices, built on exactly one `Collective`.

A strategy owns its collective as a member (``self.collective``), and every higher-order
communication helper below — `reduce`, `broadcast`, uneven `all_gather`,
`reduce_boolean_decision` — is written once, here, on the collective's primitives. So
"do all ranks agree?" means the same on torch.distributed, DeepSpeed, XLA or Horovod.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from accord.accelerators.accelerator import Accelerator
from accord.core.buffers import move_to_device
from accord.core.collective import Collective
from accord.core.communication import StrategyCommunication
from accord.core.run_settings import RunSettings
from accord.core.strategy_checkpoints import StrategyCheckpointing
from accord.core.sync_batchnorm import convert_sync_batchnorm
from accord.core.training import StrategyTraining
from accord.core.wrappers.policy import wrap_collective
from accord.core.wrappers.stats import CollectiveStats, InstrumentedCollective
from accord.core.wrappers.wrapper import unwrap
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision, PrecisionMode

if TYPE_CHECKING:
    from accord.launchers.launcher import Launcher

__all__ = ["RunSettings", "Strategy", "move_to_device"]

T = TypeVar("T")
_C = TypeVar("_C", bound=Collective)


# Returned where a context has nothing to do; a nullcontext can be entered again and again.
_NO_CONTEXT = contextlib.nullcontext()


class Strategy(StrategyTraining, StrategyCommunication, StrategyCheckpointing):
    """Base class of every strategy.

    Args:
        accelerator: the device kind; the Trainer fills it in when omitted.
        collective: the collective to communicate with; default: `default_collective()`.
        cluster_environment: where ranks and the rendezvous address come from.
        precision: the `Precision` to train in; default ``32-true``, or the Trainer's
            ``precision=``. Given here, it wins over the Trainer's default, and a Trainer
            that asks for another precision is a `ConfigurationError`.
        debug: check before every collective call that all ranks make the same call
            (`DebugCollective`); also on when ``ACCORD_DEBUG_COLLECTIVES=1``.

    To change how a strategy communicates, pass ``collective=`` or override
    `default_collective` in a subclass: nothing in a strategy calls a backend's
    communication functions except through ``self.collective``.
    """

    survives_rank_loss: ClassVar[bool] = False
    """Whether a fit can go on without a lost rank (``Trainer(on_rank_loss="continue")``):
    every rank holds the whole training state, and `rewrap` wraps the module for the
    group the survivors form."""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        collective: Collective | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        debug: bool = False,
    ) -> None:
        self.accelerator = accelerator
        self.cluster_environment = cluster_environment
        self.precision = precision if precision is not None else Precision()
        # A precision given here wins over the Trainer's default (see `connect`).
        self.precision_given = precision is not None
        self.debug = debug
        self.run_settings = RunSettings()
        self.collective_stats: CollectiveStats | None = None
        self._given_collective = collective
        self._collective: Collective | None = None
        self._launcher: Launcher | None = None

    @property
    def needs_own_process(self) -> bool:
        """Whether this strategy's training must run in a process that did nothing else.

        False by default. The XLA strategies say True: torch_xla's runtime, once started in
        a process, stays there (and no ranks can be launched from it), and a process whose
        autograd engine already ran on the CPU cannot run backward on an XLA device.
        `accord.testing.assert_strategies_agree` runs such a strategy in a fresh process.
        """
        return False

    @property
    def compile_refusal(self) -> str | None:
        """Why this strategy cannot train a ``torch.compile``'d model, or None where it can.

        None by default. The Trainer refuses a model compiled whole, or one holding
        compiled parts, with this reason before any process starts; a strategy that
        cannot run compiled code (DataParallel's replicas, XLA's own graphs) says why here.
        """
        return None

    # ------------------------------------------------------------- the collective
    @abstractmethod
    def default_collective(self) -> Collective:
        """The collective this strategy uses when none was injected.

        This is the one hook a subclass overrides to change communication.
        """

    @property
    def collective(self) -> Collective:
        """The strategy's collective: the injected one, else `default_collective()`.

        With ``debug`` (or ``ACCORD_DEBUG_COLLECTIVES=1``) it is wrapped in a
        `DebugCollective`; with ``collective_stats`` set, in an `InstrumentedCollective`
        that counts calls and time; with ``ACCORD_COLLECTIVE_TIMEOUT`` set, in a
        `WatchdogCollective`.
        """
        if self._collective is None:
            given = self._given_collective
            self._collective = wrap_collective(
                given if given is not None else self.default_collective(),
                debug=self.debug,
                stats=self.collective_stats,
                watchdog=self.run_settings.on_rank_loss != "continue",
            )
        return self._collective

    @collective.setter
    def collective(self, collective: Collective) -> None:
        self._given_collective = collective
        self._collective = None

    @property
    def base_collective(self) -> Collective:
        """The backend collective inside any debug, statistics or watchdog wrappers."""
        return unwrap(self.collective)

    def engine_collective(self, kind: type[_C]) -> _C:
        """The collective as a ``kind``, for the engine operations only that kind has.

        Engine-specific operations (a process group or device mesh, Horovod's parameter
        broadcast and join, XLA's gradient reduction) are methods of the engine's
        collective; a strategy reaches them here, through any debug, statistics or
        watchdog wrappers, and a user's subclass of ``kind`` is accepted.

        Raises:
            ConfigurationError: the collective is not a ``kind``.
        """
        base = unwrap(self.collective)
        if not isinstance(base, kind):
            raise ConfigurationError(
                f"{type(self).__name__} needs a {kind.__name__} (or a subclass of it) for "
                f"{kind.__name__}'s own operations, but its collective is a "
                f"{type(base).__name__}. Pass collective={kind.__name__}(...) or a subclass, "
                "or override default_collective() to return one."
            )
        return base

    def enable_collective_stats(self) -> CollectiveStats:
        """Count calls and time of every collective op on this rank from now on."""
        if self.collective_stats is None:
            self.collective_stats = CollectiveStats()
            if self._collective is not None:
                self._collective = InstrumentedCollective(self._collective, self.collective_stats)
        return self.collective_stats

    # ------------------------------------------------------------------ identity
    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes."""
        if self._collective is not None and self._collective.is_setup:
            return self._collective.rank
        if self.membership is not None:
            return self.membership[0]
        env = self.cluster_environment
        return env.global_rank() if env is not None else 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        env = self.cluster_environment
        return env.local_rank() if env is not None else 0

    @property
    def node_rank(self) -> int:
        """Rank of this process's node."""
        env = self.cluster_environment
        return env.node_rank() if env is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes taking part."""
        if self._collective is not None and self._collective.is_setup:
            return self._collective.world_size
        if self.membership is not None:
            return self.membership[1]
        env = self.cluster_environment
        return env.world_size() if env is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the one that writes files and prints."""
        return self.global_rank == 0

    @property
    def launcher(self) -> Launcher | None:
        """How processes are started, or None when they already run (torchrun, SLURM)."""
        return self._launcher

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas``/``rank`` for a `DistributedSampler`, or None when not sharding data."""
        return None

    # ----------------------------------------------------------------- lifecycle
    def configure_devices(
        self, devices: list[torch.device], num_nodes: int, environment: ClusterEnvironment
    ) -> None:
        """Take the devices the Trainer's ``devices=`` names on this machine, its
        ``num_nodes=``, and the cluster environment it detected (kept unless one was given).

        Each kind of strategy refuses what it cannot train on here, before any process
        starts.

        Raises:
            ConfigurationError: a device count this strategy cannot train on.
        """
        if self.cluster_environment is None:
            self.cluster_environment = environment

    def configure_launcher(self) -> None:
        """Decide `launcher`; called once the Trainer has filled in devices and environment."""

    def configure_run(self, settings: RunSettings) -> None:
        """Take the Trainer's settings for the run about to start (before
        `setup_environment`)."""
        wrapped = self._collective
        if (
            wrapped is not None
            and not wrapped.is_setup
            and settings.on_rank_loss != self.run_settings.on_rank_loss
        ):
            self._collective = None  # wrapped again: with or without the watchdog
        self.run_settings = settings

    def setup_environment(self) -> None:
        """Prepare the device and set the collective up (create or join the group)."""
        if self.accelerator is not None:  # a strategy used without a Trainer may have none
            self.accelerator.setup_device(self.root_device)
        self.collective.setup(**self.collective_setup_kwargs())
        # lightning_utilities' rank_zero_* helpers print on this process's global rank.
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def collective_setup_kwargs(self) -> dict[str, Any]:
        """Arguments passed to ``collective.setup()``."""
        return {}

    def check_manual_optimization(self) -> None:
        """Refuse manual optimization (``automatic_optimization = False``) where this
        strategy cannot run it; the Trainer asks before it starts any process.

        One-process strategies run it as they are.
        """

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and wrap it as the strategy needs; with
        ``sync_batchnorm`` in the run's settings, its BatchNorm layers compute their
        statistics over all ranks first (`accord.core.sync_batchnorm`)."""
        if self.run_settings.sync_batchnorm:
            module = convert_sync_batchnorm(module, self.collective)
        return self.precision.convert_module(module.to(self.root_device))

    def rewrap(self, module: nn.Module) -> nn.Module:
        """``module`` (as `setup_module` returned it) wrapped anew for the group the
        collective has after `regroup`: a strategy whose wrapper holds the old group
        replaces it; the default returns ``module``. Every rank of the new group calls it."""
        return module

    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Wrap or replace the optimizers (most strategies keep them)."""
        return optimizers

    def on_exception(self, exception: BaseException) -> None:
        """The run failed on this rank with ``exception``: the collective will not wait for
        the other ranks when it is torn down (they may be gone)."""
        if self._collective is not None:
            self._collective.abandon()

    def teardown(self) -> None:
        """Release the collective (only what it created), the device and the environment."""
        if self._collective is not None:
            self._collective.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    def check_precision(self, mode: PrecisionMode, device: torch.device) -> None:
        """Refuse a precision this strategy cannot run on ``device``, before any process starts.

        Raises:
            ConfigurationError: ``16-mixed`` on CPU; engines add their own cases.
        """
        if mode is PrecisionMode.FP16_MIXED and device.type == "cpu":
            raise ConfigurationError(
                "precision='16-mixed' needs a CUDA device; on CPU use precision='bf16-mixed'."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(collective={type(self.collective).__name__})"
