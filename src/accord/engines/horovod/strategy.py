"""`HorovodStrategy`: data parallel training with Horovod's ``DistributedOptimizer``.

Horovod is imported only when a run starts, so ``import accord`` and building the
registry never import it; building the strategy without Horovod installed raises
`MissingDependencyError`, which says how to install it.

How a run maps onto Horovod:

- processes: ``horovodrun -np N python script.py`` starts them (on several machines with
  ``-H host1:4,host2:4``); accord starts none. Ranks, the world size and the node come
  from Horovod (``hvd.rank()``, ``hvd.size()``, ``hvd.local_rank()``,
  ``hvd.cross_rank()``), and so do the `DistributedSampler` arguments. A plain
  ``python script.py`` asking for more than one device is a `ConfigurationError` that
  shows the horovodrun command; with one device it is a Horovod group of one.
- communication: the strategy's collective is a `HorovodCollective` (``setup`` calls
  ``hvd.init()``), so ``reduce``, ``broadcast``, ``all_gather``, ``barrier`` and
  ``reduce_boolean_decision`` run on Horovod.
- model and optimizers: rank 0's parameters and buffers are broadcast to every rank
  (``hvd.broadcast_parameters``), each optimizer becomes an ``hvd.DistributedOptimizer``
  over the module's named parameters, whose backward hooks average the gradients while
  backward runs, and rank 0's optimizer state is broadcast
  (``hvd.broadcast_optimizer_state``). A fresh optimizer has no state yet: then only its
  hyper-parameters are broadcast, because Horovod would create the state with a
  zero-gradient step, which counts a step (Adam) and moves the weights (weight decay).
- gradient accumulation: ``backward_passes_per_step`` is the Trainer's
  ``accumulate_grad_batches`` unless given, so the hooks reduce once per window. At the
  end of every window (and before any clipping or loss-scale unscaling) the strategy
  waits for the reductions (``optimizer.synchronize()``) and steps with
  ``skip_synchronize()``; a short last window of an epoch is reduced when it steps.
- uneven data: after a rank's last training batch of an epoch it calls `join`
  (``hvd.join()``): until every rank has joined it takes part in the others' gradient
  reductions with zeros. If the ranks took different numbers of optimizer steps, the
  rank that took the most then broadcasts its weights and optimizer state, so all ranks
  continue from the same model. While a rank is joined the others may only reduce
  gradients: metrics logged with ``sync_dist=True`` on step, or other collectives, in
  their extra batches are not supported by Horovod's join.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy
from accord.engines.horovod.collective import _MOVABLE, HorovodCollective, _hvd, horovod_available
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError, MissingDependencyError
from accord.precision import Precision

__all__ = ["BFloat16AsFloat32", "HorovodStrategy", "launched_by_horovod"]

# What horovodrun (gloo) or mpirun (Open MPI, MPICH/PMI) set in each process it starts.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_NODE_RANK_VARS = ("HOROVOD_CROSS_RANK",)


def launched_by_horovod() -> bool:
    """Whether this process was started by ``horovodrun`` (or ``mpirun``)."""
    return any(name in os.environ for name in _RANK_VARS)


def _env_int(names: Iterable[str], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise ConfigurationError(
                    f"Environment variable {name}={raw!r} is not an integer."
                ) from None
    return default


def _is_distributed_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize")


class HorovodStrategy(ParallelStrategy):
    """Data parallel training on Horovod, one process per device, started by horovodrun.

    Run the training script as ``horovodrun -np N python script.py`` with
    ``Trainer(strategy="horovod")``; see the module docstring for what happens where.

    Args:
        backward_passes_per_step: backward passes whose gradients add up before one
            reduction; default: the Trainer's ``accumulate_grad_batches``.
        compression: an ``hvd.Compression`` for the gradient reductions (default none).
        gradient_predivide_factor: split the gradient average into a division by this
            factor before the sum and by ``world_size / factor`` after it.
        **optimizer_kwargs: more arguments for ``hvd.DistributedOptimizer``.
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes, debug:
            as `ParallelStrategy`. Horovod assigns ranks, so ``num_nodes`` only sizes the
            horovodrun command suggested when processes are missing.

    Raises:
        MissingDependencyError: horovod is not installed.
        ConfigurationError: ``backward_passes_per_step`` below 1.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        *,
        backward_passes_per_step: int | None = None,
        compression: Any = None,
        gradient_predivide_factor: float = 1.0,
        debug: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        if not horovod_available():
            raise MissingDependencyError("HorovodStrategy", "horovod", "horovod")
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            collective,
            precision,
            num_nodes,
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
        self._module: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._synchronized: set[int] = set()
        self._window_ends = True
        self._last_batch = False
        self._steps_this_epoch = 0

    @override
    def default_collective(self) -> Collective:
        return HorovodCollective()

    # ------------------------------------------------------------------ identity
    def _horovod_collective(self) -> HorovodCollective | None:
        """The set-up `HorovodCollective` under any wrappers, or None."""
        if self._collective is None or not self._collective.is_setup:
            return None
        base = self.base_collective
        return base if isinstance(base, HorovodCollective) else None

    @property
    @override
    def global_rank(self) -> int:
        """``hvd.rank()``; before setup, the rank horovodrun gave this process (else 0)."""
        if self._collective is not None and self._collective.is_setup:
            return self._collective.rank
        return _env_int(_RANK_VARS, 0)

    @property
    @override
    def local_rank(self) -> int:
        """``hvd.local_rank()``; before setup, horovodrun's ``HOROVOD_LOCAL_RANK`` (else 0)."""
        collective = self._horovod_collective()
        if collective is not None:
            return collective.local_rank
        return _env_int(_LOCAL_RANK_VARS, 0)

    @property
    @override
    def node_rank(self) -> int:
        """``hvd.cross_rank()``: the rank of this machine; before setup, from horovodrun."""
        collective = self._horovod_collective()
        if collective is not None:
            return collective.cross_rank
        return _env_int(_NODE_RANK_VARS, 0)

    @property
    @override
    def world_size(self) -> int:
        """``hvd.size()``; before setup, the process count horovodrun started (else 1)."""
        if self._collective is not None and self._collective.is_setup:
            return self._collective.world_size
        return _env_int(_SIZE_VARS, 1)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas=hvd.size()``, ``rank=hvd.rank()``."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ----------------------------------------------------------------- lifecycle
    @override
    def _configure_launcher(self) -> None:
        """Horovod's launcher starts the processes; a plain script gets one, or an error."""
        self._launcher = None
        requested = self.num_processes * self.num_nodes
        if requested > 1 and not launched_by_horovod():
            script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "script.py"
            hosts = (
                f" -H host1:{self.num_processes},host2:{self.num_processes},..."
                if self.num_nodes > 1
                else ""
            )
            raise ConfigurationError(
                f"HorovodStrategy does not start processes: horovodrun does. This run asks "
                f"for {requested} processes (devices={self.num_processes}, "
                f"num_nodes={self.num_nodes}) but was started as a single process. Run "
                f"`horovodrun -np {requested}{hosts} python {script}` instead; each "
                "process it starts trains on one device."
            )

    @override
    def validate_cluster(self, num_devices: int, num_nodes: int) -> None:
        """Nothing to check here: horovodrun forms the group (see `_configure_launcher`)."""

    @override
    def configure_ranks(self) -> None:
        """Nothing to do: Horovod assigns ranks and the world size."""

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}

    @override
    def setup_environment(self) -> None:
        """Set up the device and the collective; Horovod must be initialised after it."""
        super().setup_environment()
        if not _hvd().is_initialized():
            raise ConfigurationError(
                f"HorovodStrategy trains through hvd.DistributedOptimizer, but "
                f"{type(self.base_collective).__name__}.setup() did not initialise Horovod. "
                "Use a HorovodCollective (or a subclass of it), or call hvd.init() first."
            )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and give every rank rank 0's weights and buffers."""
        module = super().setup_module(module)
        self._module = module
        if self.world_size > 1:
            self._broadcast_module(module, src=0)
        return module

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Wrap each optimizer in ``hvd.DistributedOptimizer`` and broadcast rank 0's state.

        The wrapper is a new optimizer object sharing the original's parameter groups, so
        learning-rate schedulers built on the original still change its learning rates.
        """
        hvd = _hvd()
        passes = self._backward_passes()
        named = list(self.unwrap(module).named_parameters())
        kwargs: dict[str, Any] = {
            "backward_passes_per_step": passes,
            "op": hvd.Average,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            **self.optimizer_kwargs,
        }
        if self.compression is not None:
            kwargs["compression"] = self.compression
        elif any(p.dtype == torch.bfloat16 for _, p in named):
            kwargs["compression"] = BFloat16AsFloat32
        wrapped: list[torch.optim.Optimizer] = []
        for index, optimizer in enumerate(optimizers):
            names = _parameter_names(optimizer, named, index)
            distributed = hvd.DistributedOptimizer(optimizer, named_parameters=names, **kwargs)
            self._broadcast_optimizer(distributed, src=0)
            wrapped.append(distributed)
        self._optimizers = wrapped
        self._synchronized.clear()
        self._steps_this_epoch = 0
        return wrapped

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
        """Forget the wrapped optimizers, then release the collective (``hvd.shutdown()``)."""
        self._module = None
        self._optimizers = []
        self._synchronized.clear()
        super().teardown()

    # ------------------------------------------------------------ training step
    @override
    def on_train_batch_start(self, batch_idx: int, last: bool) -> None:
        """Note whether this is the epoch's last batch: its optimizer step then joins."""
        self._last_batch = last

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Horovod holds back the reductions itself; this notes whether a window ends."""
        self._window_ends = not enabled
        return contextlib.nullcontext()

    @override
    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        """Backpropagate; at the end of an accumulation window, wait for the gradients."""
        super().backward(loss, module)
        if self._window_ends:
            for optimizer in self._optimizers:
                self._synchronize(optimizer)

    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        if _is_distributed_optimizer(optimizer) and id(optimizer) not in self._synchronized:
            optimizer.synchronize()  # type: ignore[attr-defined]
            self._synchronized.add(id(optimizer))

    @override
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Clip the averaged gradients (the reductions are waited for first)."""
        self._synchronize(optimizer)
        return super().clip_gradients(module, optimizer, max_norm)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """Step on averaged gradients; after a rank's last batch of an epoch, `join`."""
        self._synchronize(optimizer)
        self._synchronized.discard(id(optimizer))
        with _skip_synchronize(optimizer):
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
        """Say this rank is out of data and wait for every rank (``hvd.join()``).

        Until all ranks have joined, this rank takes part in the others' gradient
        reductions with zeros. Returns the rank that joined last. The strategy calls it
        after each rank's last training batch of an epoch.
        """
        collective = self._horovod_collective()
        if collective is not None:
            return collective.join(self.root_device)
        device = self.root_device
        return int(_hvd().join(device.index if device.type == "cuda" else -1))

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
            src = per_rank.index(max(per_rank))
            self._broadcast_module(module, src=src)
            for optimizer in self._optimizers:
                _hvd().broadcast_optimizer_state(optimizer, root_rank=src)

    # -------------------------------------------------------------- broadcasting
    def _broadcast_module(self, module: nn.Module, src: int) -> None:
        """Overwrite every parameter and buffer with rank ``src``'s, in place."""
        native: dict[str, torch.Tensor] = {}
        for name, tensor in self.unwrap(module).state_dict(keep_vars=False).items():
            if not tensor.numel():
                continue
            if tensor.dtype in _MOVABLE and tensor.is_contiguous():
                native[name] = tensor
            else:  # dtypes Horovod cannot move (bool, bfloat16, ...) go through the collective
                self.collective.broadcast(tensor, src, out=tensor)
        if native:
            _hvd().broadcast_parameters(native, root_rank=src)

    def _broadcast_optimizer(self, optimizer: torch.optim.Optimizer, src: int) -> None:
        if self.world_size == 1:
            return
        has_state = bool(self.collective.broadcast_object(bool(optimizer.state), src))
        if has_state:
            _hvd().broadcast_optimizer_state(optimizer, root_rank=src)
            return
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        settings = self.collective.broadcast_object(settings, src)
        for group, values in zip(optimizer.param_groups, settings, strict=True):
            group.update(values)


class BFloat16AsFloat32:
    """A Horovod gradient compression that sends bfloat16 gradients as float32.

    Horovod's reductions have no bfloat16 kernel, so ``bf16-true`` gradients travel as
    float32 and come back as bfloat16; other dtypes pass unchanged. `HorovodStrategy`
    uses it when the module has bfloat16 parameters and no ``compression`` was given.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        """The tensor to reduce, and the dtype to give the result back in (or None)."""
        if tensor.dtype == torch.bfloat16:
            return tensor.to(torch.float32), torch.bfloat16
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        """Undo `compress`."""
        return tensor if ctx is None else tensor.to(ctx)


@contextlib.contextmanager
def _skip_synchronize(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    if _is_distributed_optimizer(optimizer):
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            yield
    else:
        yield


def _parameter_names(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], index: int
) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) for every parameter of ``optimizer``: the module's names, else made up.

    Horovod names each gradient reduction after its parameter; the names must be unique
    and the same on every rank.
    """
    names = {id(p): n for n, p in named}
    result: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            result.append((names.get(id(param), f"optimizer{index}.group{g}.param{j}"), param))
    return result
