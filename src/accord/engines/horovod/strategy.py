"""`HorovodStrategy`: data parallel training with Horovod's ``DistributedOptimizer``.

Horovod is imported only when a run starts, so ``import accord`` and building the
registry never import it; building the strategy without Horovod installed raises
`MissingDependencyError`, which says how to install it.

How a run maps onto Horovod:

- processes: ``horovodrun -np N python script.py`` starts them (on several machines with
  ``-H host1:4,host2:4``); accord starts none. Before the run the ranks come from what
  the launcher set (`HorovodEnvironment`), during it from Horovod itself through the
  `HorovodCollective`, and so do the `DistributedSampler` arguments. A plain
  ``python script.py`` asking for more than one device is a `ConfigurationError` that
  shows the horovodrun command; with one device it is a Horovod group of one.
- communication: all of it goes through the strategy's `HorovodCollective` (its
  ``setup`` initialises Horovod): ``reduce``, ``broadcast``, ``all_gather``, ``barrier``
  and ``reduce_boolean_decision``, and Horovod's own operations below.
- model and optimizers: rank 0's parameters and buffers are broadcast to every rank
  (`HorovodCollective.broadcast_module`), each optimizer is wrapped in Horovod's
  ``DistributedOptimizer`` over the module's named parameters
  (`HorovodCollective.distributed_optimizer`), whose backward hooks average the
  gradients while backward runs, and rank 0's optimizer state is broadcast
  (`HorovodCollective.broadcast_optimizer_state`; a fresh optimizer sends only its
  hyper-parameters).
- gradient accumulation: ``backward_passes_per_step`` is the Trainer's
  ``accumulate_grad_batches`` unless given, so the hooks reduce once per window. At the
  end of every window (and before any clipping or loss-scale unscaling) the strategy
  waits for the reductions (`HorovodCollective.synchronize`) and steps with
  ``skip_synchronize()``; a short last window of an epoch is reduced when it steps.
- uneven data: after a rank's last training batch of an epoch it calls `join`
  (`HorovodCollective.join`): until every rank has joined it takes part in the others'
  gradient reductions with zeros. If the ranks took different numbers of optimizer
  steps, the rank that took the most then broadcasts its optimizer state and weights,
  so all ranks continue from the same model. While a rank is joined the others may only
  reduce gradients: metrics logged with ``sync_dist=True`` on step, or other
  collectives, in their extra batches are not supported by Horovod's join.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy
from accord.engines.horovod.collective import HorovodCollective
from accord.engines.horovod.dtypes import BFloat16AsFloat32
from accord.engines.horovod.environment import HorovodEnvironment, launched_by_horovod
from accord.engines.horovod.optimizer import (
    is_distributed_optimizer,
    parameter_names,
    skip_synchronize,
)
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.imports import require
from accord.precision import Precision

__all__ = ["BFloat16AsFloat32", "HorovodStrategy", "launched_by_horovod"]


class HorovodStrategy(ParallelStrategy):
    """Data parallel training on Horovod, one process per device, started by horovodrun.

    Run the training script as ``horovodrun -np N python script.py`` with
    ``Trainer(strategy="horovod")``; see the module docstring for what happens where.

    Args:
        backward_passes_per_step: backward passes whose gradients add up before one
            reduction; default: the Trainer's ``accumulate_grad_batches``.
        compression: a Horovod compression (``horovod.torch.Compression``) for the
            gradient reductions (default none).
        gradient_predivide_factor: split the gradient average into a division by this
            factor before the sum and by ``world_size / factor`` after it.
        **optimizer_kwargs: more arguments for Horovod's ``DistributedOptimizer``.
        collective: a `HorovodCollective` or a subclass of it (the default); its methods
            carry Horovod's own operations.
        accelerator, parallel_devices, cluster_environment, precision, num_nodes, debug:
            as `ParallelStrategy`; the environment defaults to `HorovodEnvironment`.
            Horovod assigns ranks, so ``num_nodes`` only sizes the horovodrun command
            suggested when processes are missing.

    Raises:
        MissingDependencyError: horovod is not installed.
        ConfigurationError: ``backward_passes_per_step`` below 1.
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
        backward_passes_per_step: int | None = None,
        compression: Any = None,
        gradient_predivide_factor: float = 1.0,
        debug: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        require("horovod", "HorovodStrategy")
        super().__init__(
            accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=(
                cluster_environment if cluster_environment is not None else HorovodEnvironment()
            ),
            collective=collective,
            precision=precision,
            num_nodes=num_nodes,
            debug=debug,
        )
        if backward_passes_per_step is not None and (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise ConfigurationError(
                f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1 "
                "(or None for the Trainer's accumulate_grad_batches)."
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        self.optimizer_kwargs = optimizer_kwargs
        self._optimizers: list[torch.optim.Optimizer] = []
        self._synchronized: set[int] = set()
        self._window_ends = True
        self._last_batch = False
        self._steps_this_epoch = 0

    @override
    def external_launch_command(self, num_processes: int) -> list[str] | None:
        """``horovodrun --gloo -np N -H localhost:N``: Horovod's ranks are started by it.

        The ``horovodrun`` beside this Python interpreter is preferred, then the one on
        ``PATH``.
        """
        beside = Path(sys.executable).with_name("horovodrun")
        found = str(beside) if beside.exists() else shutil.which("horovodrun")
        if found is None:
            raise ConfigurationError(
                "Horovod's ranks are started by horovodrun, which is neither beside "
                f"{sys.executable} nor on PATH; install horovod with its launcher."
            )
        n = str(num_processes)
        return [found, "--gloo", "-np", n, "-H", f"localhost:{n}"]

    @override
    def default_collective(self) -> Collective:
        return HorovodCollective()

    def _horovod(self) -> HorovodCollective:
        return self.engine_collective(HorovodCollective)

    # ------------------------------------------------------------------ identity
    def _running(self) -> bool:
        return self._collective is not None and self._collective.is_setup

    @property
    @override
    def local_rank(self) -> int:
        """Horovod's local rank; before setup, the one the launcher set (else 0)."""
        return self._horovod().local_rank if self._running() else super().local_rank

    @property
    @override
    def node_rank(self) -> int:
        """Horovod's cross rank (this machine's); before setup, the launcher's (else 0)."""
        return self._horovod().cross_rank if self._running() else super().node_rank

    # ----------------------------------------------------------------- lifecycle
    @override
    def configure_ranks(self) -> None:
        """Nothing to do: Horovod assigns ranks and the world size."""

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}

    @override
    def setup_environment(self) -> None:
        """Set up the device and the collective; Horovod must be initialised after it.

        Raises:
            ConfigurationError: the collective is not a `HorovodCollective`, or its
                ``setup()`` did not initialise Horovod.
        """
        horovod = self._horovod()
        super().setup_environment()
        if not horovod.horovod_initialized:
            raise ConfigurationError(
                "HorovodStrategy trains through Horovod's DistributedOptimizer, but "
                f"{type(horovod).__name__}.setup() did not initialise Horovod. Call "
                "HorovodCollective.setup() from the subclass's setup()."
            )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and give every rank rank 0's weights and buffers."""
        module = super().setup_module(module)
        self._horovod().broadcast_module(self.unwrap(module), src=0)
        return module

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Wrap each optimizer in Horovod's ``DistributedOptimizer``; broadcast rank 0's state.

        The wrapper is a new optimizer object sharing the original's parameter groups, so
        learning-rate schedulers built on the original still change its learning rates.
        """
        options: dict[str, Any] = {
            "backward_passes_per_step": self._backward_passes(),
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "compression": self.compression,
            **self.optimizer_kwargs,
        }
        named = list(self.unwrap(module).named_parameters())
        wrapped: list[torch.optim.Optimizer] = []
        for index, optimizer in enumerate(optimizers):
            names = parameter_names(optimizer, named, index)
            distributed = self._horovod().distributed_optimizer(optimizer, names, **options)
            self._horovod().broadcast_optimizer_state(distributed, src=0)
            wrapped.append(distributed)
        self._optimizers = wrapped
        self._synchronized.clear()
        self._steps_this_epoch = 0
        return wrapped

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load ``state`` into the wrapper, keeping the groups it shares with the original.

        torch's ``load_state_dict`` replaces the parameter groups with new dicts; the
        learning-rate schedulers, built on the original optimizer, would then change
        learning rates the wrapper no longer reads. The loaded values go into the shared
        dicts instead.
        """
        shared = optimizer.param_groups
        super().load_optimizer_state_dict(optimizer, state)
        if len(shared) == len(optimizer.param_groups):
            for kept, loaded in zip(shared, optimizer.param_groups, strict=True):
                kept.update(loaded)
            optimizer.param_groups = shared

    def _backward_passes(self) -> int:
        accumulate = self.run_settings.accumulate_grad_batches
        passes = self.backward_passes_per_step
        if passes is None:
            return accumulate
        if passes < accumulate:
            raise ConfigurationError(
                f"HorovodStrategy(backward_passes_per_step={passes}) is smaller than the "
                f"Trainer's accumulate_grad_batches={accumulate}: Horovod would see more "
                "backward passes than it expects before a step. Leave it unset to follow "
                "the Trainer."
            )
        return passes

    @override
    def teardown(self) -> None:
        """Forget the wrapped optimizers, then release the collective (and Horovod)."""
        self._optimizers = []
        self._synchronized.clear()
        super().teardown()

    # ------------------------------------------------------------ training step
    @override
    def on_train_batch_start(self, batch_idx: int, last: bool, window_ends: bool = True) -> None:
        """Note whether this is the epoch's last batch (its optimizer step then joins) and
        whether its backward ends an accumulation window (then it waits for the
        gradients)."""
        self._last_batch = last
        self._window_ends = window_ends

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Horovod holds back the reductions itself; this notes whether a window ends."""
        self._window_ends = not enabled
        return contextlib.nullcontext()

    @override
    def backward(
        self,
        loss: torch.Tensor,
        module: nn.Module,
        backward_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Backpropagate; at the end of an accumulation window, wait for the gradients."""
        super().backward(loss, module, backward_fn)
        if self._window_ends:
            for optimizer in self._optimizers:
                self._synchronize(optimizer)

    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        if is_distributed_optimizer(optimizer) and id(optimizer) not in self._synchronized:
            self._horovod().synchronize(optimizer)
            self._synchronized.add(id(optimizer))

    @override
    def _finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Clipping reads the averaged gradients: the reductions are waited for first."""
        self._synchronize(optimizer)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        closure: Callable[[], Any] | None = None,
    ) -> None:
        """Step on averaged gradients; after a rank's last batch of an epoch, `join`.

        Raises:
            ConfigurationError: an optimizer that needs a closure.
        """
        if closure is not None:
            raise ConfigurationError(
                f"{type(optimizer).__name__} needs a closure in step(), which Horovod's "
                "DistributedOptimizer cannot run; use an optimizer without one."
            )
        self._synchronize(optimizer)
        self._synchronized.discard(id(optimizer))
        with skip_synchronize(optimizer):
            super().optimizer_step(optimizer, module)
        if not self._optimizers or optimizer is self._optimizers[-1]:
            self._steps_this_epoch += 1
            if self._last_batch:
                self._join_after_last_batch(module)

    @override
    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        # DistributedOptimizer.zero_grad() takes no arguments; it sets gradients to None.
        optimizer.zero_grad()

    # ------------------------------------------------------------------ uneven data
    def join(self) -> int:
        """Say this rank is out of data and wait for every rank (`HorovodCollective.join`).

        Until all ranks have joined, this rank takes part in the others' gradient
        reductions with zeros. Returns the rank that joined last. The strategy calls it
        after each rank's last training batch of an epoch.
        """
        return self._horovod().join(self.root_device)

    def _join_after_last_batch(self, module: nn.Module) -> None:
        steps, self._steps_this_epoch = self._steps_this_epoch, 0
        if self.world_size == 1:
            return
        self.join()
        counts = self.collective.all_gather(torch.tensor([steps], dtype=torch.int64))
        per_rank = [int(n) for n in counts.flatten().tolist()]
        if len(set(per_rank)) > 1:
            # The ranks that ran out of data first skipped steps: continue from the rank
            # that took the most (the lowest such rank, so every rank picks the same).
            # Optimizers first: a rank without optimizer state creates it with a step.
            src = per_rank.index(max(per_rank))
            for optimizer in self._optimizers:
                self._horovod().broadcast_optimizer_state(optimizer, src=src)
            self._horovod().broadcast_module(self.unwrap(module), src=src)
