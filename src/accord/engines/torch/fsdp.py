"""`FSDPStrategy`: one process per device, parameters sharded by FSDP2 (``fully_shard``).

The model is wrapped in a `StepModule` and the wrapper becomes FSDP's root unit, so every
step hook (``training_step``, ...) runs inside the root's forward: FSDP all-gathers the
parameters the user's module owns directly before the hook runs, whether or not the hook
calls ``self(x)``, and reduce-scatters their gradients in backward. Submodules chosen by
the wrap policy become units of their own and are gathered when they are called.

FSDP shards over the device mesh the strategy's `TorchCollective` builds
(`TorchCollective.device_mesh`), so its all-gathers and reduce-scatters run on that
collective's process group: a collective on a sub-group shards within the sub-group.
Checkpoints are sharded directories or full files
(`accord.engines.torch.fsdp_checkpoint_directory`), read and written by its base class
`_FSDPCheckpoints` (`accord.engines.torch.fsdp_strategy_checkpoints`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.step_module import StepModule
from accord.core.timeouts import DEFAULT_TIMEOUT
from accord.engines.torch.collective import TorchCollective, default_torch_backend
from accord.engines.torch.fsdp_checkpoint_directory import META_FILE
from accord.engines.torch.fsdp_strategy_checkpoints import StateDictType, _FSDPCheckpoints
from accord.engines.torch.fsdp_units import fully_shard_options, shard_units
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = ["META_FILE", "FSDPStrategy", "hybrid_mesh_shape"]

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]

_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
_STATE_DICT_TYPES = ("sharded", "full")


class FSDPStrategy(_FSDPCheckpoints):
    """Fully sharded data parallel training on FSDP2 (`torch.distributed.fsdp.fully_shard`).

    Args:
        auto_wrap_policy: module classes to shard as units of their own (e.g. a model's
            transformer block). When None, every submodule whose parameters not yet in a
            unit reach ``min_num_params`` becomes one. The user's module itself always
            belongs to the root unit.
        min_num_params: the size rule used when ``auto_wrap_policy`` is None.
        cpu_offload: keep sharded parameters, gradients and the optimizer step on the CPU
            (FSDP2's ``CPUOffloadPolicy``).
        sharding_strategy: ``"FULL_SHARD"`` frees gathered parameters after each unit's
            forward; ``"SHARD_GRAD_OP"`` keeps them until backward (more memory, less
            communication); ``"HYBRID_SHARD"`` shards within groups of
            ``hybrid_shard_size`` ranks and replicates across groups (a 2-D device mesh).
        hybrid_shard_size: ranks per shard group for ``HYBRID_SHARD``; default: the
            processes on one node.
        state_dict_type: ``"sharded"`` or ``"full"``: how checkpoints are written
            (`accord.engines.torch.fsdp_checkpoint_directory`). Loading accepts both kinds.
        process_group_backend, timeout: as `ParallelStrategy` (the backend's default: nccl
            on CUDA, gloo otherwise).
        accelerator, parallel_devices, cluster_environment, precision, num_nodes, debug:
            as `ParallelStrategy`.
        collective: a `TorchCollective` or a subclass (wrapped or not); FSDP shards over
            the device mesh it builds, on its process group.

    Mixed precision follows the Trainer's ``precision``: ``bf16-mixed`` gathers parameters
    in bf16 and reduces gradients in fp32 (``16-mixed`` likewise with fp16).

    Local ranks are started by re-running the script (like ``torchrun``) or come from
    torchrun/SLURM; ``spawn``/``fork`` are not offered, because their way of returning the
    trained weights to the launching process would pickle DTensors whose process group is
    gone. For the same reason a module keeps its sharded parameters after a run: to use
    the weights elsewhere, save a ``"full"`` checkpoint, or pass ``ckpt_path=`` to the next
    run with a new module.
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
        auto_wrap_policy: set[type[nn.Module]] | None = None,
        min_num_params: int = 100_000,
        cpu_offload: bool = False,
        sharding_strategy: ShardingStrategy = "FULL_SHARD",
        hybrid_shard_size: int | None = None,
        state_dict_type: StateDictType = "sharded",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        debug: bool = False,
    ) -> None:
        super().__init__(
            accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            collective=collective,
            precision=precision,
            num_nodes=num_nodes,
            process_group_backend=process_group_backend,
            timeout=timeout,
            debug=debug,
        )
        if sharding_strategy not in _SHARDING_STRATEGIES:
            raise ConfigurationError(
                f"sharding_strategy={sharding_strategy!r}: use one of {_SHARDING_STRATEGIES}."
            )
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ConfigurationError(
                f"state_dict_type={state_dict_type!r}: use one of {_STATE_DICT_TYPES}."
            )
        if isinstance(min_num_params, bool) or min_num_params < 1:
            raise ConfigurationError(f"min_num_params={min_num_params!r} must be >= 1.")
        if hybrid_shard_size is not None and hybrid_shard_size < 1:
            raise ConfigurationError(f"hybrid_shard_size={hybrid_shard_size!r} must be >= 1.")
        self.auto_wrap_policy = set(auto_wrap_policy) if auto_wrap_policy else None
        self.min_num_params = min_num_params
        self.cpu_offload = cpu_offload
        self.sharding_strategy = sharding_strategy
        self.hybrid_shard_size = hybrid_shard_size
        self.state_dict_type = state_dict_type
        self.device_mesh: DeviceMesh | None = None
        self._model: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    @override
    def default_collective(self) -> Collective:
        backend = self.process_group_backend or default_torch_backend(self.root_device)
        return TorchCollective(backend, timeout=self.timeout)

    @override
    def check_manual_optimization(self) -> None:
        """Refuse manual optimization: FSDP gathers and frees parameters around the
        root's forward and reduce-scatters gradients when its backward ends, which a
        backward run inside ``training_step`` (inside that forward) does not fit.

        Raises:
            ConfigurationError: always.
        """
        raise ConfigurationError(
            "Manual optimization (automatic_optimization = False) does not run on "
            "FSDPStrategy: FSDP gathers parameters around the model's forward and "
            "reduce-scatters gradients at the end of its backward, and manual_backward runs "
            "inside training_step, inside that forward. Use strategy='ddp' (or 'ddp_spawn', "
            "'ddp_fork') for manual optimization, or automatic optimization on FSDP."
        )

    # ------------------------------------------------------------------ wrapping
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise ConfigurationError(
                f"{type(module).__name__} was already sharded by an earlier FSDP run: its "
                "parameters are DTensors tied to that run's process group. Build a new module "
                "and pass ckpt_path= (a 'full' checkpoint also loads into a plain module)."
            )
        module = super().setup_module(module)
        self.device_mesh = self._build_mesh()
        kwargs = fully_shard_options(
            self.device_mesh,
            self.precision.mode,
            cpu_offload=self.cpu_offload,
            pin_memory=self.root_device.type == "cuda",
            reshard_after_forward=self.sharding_strategy != "SHARD_GRAD_OP",
        )
        root = StepModule(module)
        # FSDP2 units are built bottom-up: children before the modules that hold them.
        for unit in self._units(module):
            fully_shard(unit, **kwargs)
        fully_shard(root, **kwargs)
        self._model = root
        self._optimizers = []
        return root

    def _build_mesh(self) -> DeviceMesh:
        """The collective's device mesh: ``(world,)``, or ``(replicate, shard)`` for hybrid."""
        collective = self.engine_collective(TorchCollective)
        device_type = self.root_device.type
        if self.sharding_strategy == "HYBRID_SHARD":
            shard_size = self.hybrid_shard_size or self.num_processes
            shape = hybrid_mesh_shape(collective.world_size, shard_size)
            return collective.device_mesh(shape, ("replicate", "shard"), device_type=device_type)
        return collective.device_mesh((collective.world_size,), device_type=device_type)

    def _units(self, module: nn.Module) -> list[nn.Module]:
        """The submodules of ``module`` to shard individually, children before parents."""
        return shard_units(module, self.auto_wrap_policy, self.min_num_params)

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        # Kept for the checkpoint methods, whose signatures do not carry the model.
        self._optimizers = list(optimizers)
        return optimizers

    @override
    def teardown(self) -> None:
        self.reshard()
        self._model = None
        self._optimizers = []
        self.device_mesh = None
        super().teardown()

    # ------------------------------------------------------------ training step
    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        # Through the root's forward, so FSDP's hooks gather parameters around the hook.
        if isinstance(model, StepModule):
            return model(name, *args)
        return super().step(model, name, *args)

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        if enabled and isinstance(module, FSDPModule):
            return _without_gradient_sync(module)
        return contextlib.nullcontext()

    @override
    def evaluation_context(self, inference_mode: bool) -> contextlib.AbstractContextManager[Any]:
        """`torch.no_grad` always: FSDP's parameter handling does not run under
        `torch.inference_mode`."""
        return torch.no_grad()

    @override
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        self.precision.unscale_gradients(optimizer)
        # On sharded (DTensor) gradients the norm is computed over every rank's shards.
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


def hybrid_mesh_shape(world_size: int, shard_size: int) -> tuple[int, int]:
    """The ``(replicate, shard)`` shape of a `HYBRID_SHARD` device mesh.

    Raises:
        ConfigurationError: the world cannot be cut into shard groups of that size.
    """
    if world_size < 2:
        raise ConfigurationError(
            f"sharding_strategy='HYBRID_SHARD' needs at least 2 processes, got "
            f"world_size={world_size}. Use 'FULL_SHARD', or more devices/nodes."
        )
    if shard_size < 1 or world_size % shard_size:
        raise ConfigurationError(
            f"sharding_strategy='HYBRID_SHARD' shards within groups of {shard_size} ranks, "
            f"which does not divide world_size={world_size}. Pass hybrid_shard_size= a "
            "divisor of the world size (default: the processes per node)."
        )
    return world_size // shard_size, shard_size


@contextlib.contextmanager
def _without_gradient_sync(module: FSDPModule) -> Iterator[None]:
    # Gradients accumulate unsharded on every rank until the next synced backward.
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
