"""`FSDPStrategy`: one process per device, parameters sharded by FSDP2 (``fully_shard``).

The model is wrapped in a `StepModule` and the wrapper becomes FSDP's root unit, so every
step hook (``training_step``, ...) runs inside the root's forward: FSDP all-gathers the
parameters the user's module owns directly before the hook runs, whether or not the hook
calls ``self(x)``, and reduce-scatters their gradients in backward. Submodules chosen by
the wrap policy become units of their own and are gathered when they are called.

Checkpoints come in two kinds, and loading accepts either:

* ``"sharded"`` (default): a directory written with `torch.distributed.checkpoint` (every
  rank writes its shards) plus ``accord_meta.pt`` with everything that is not a model or
  optimizer tensor. It loads into any number of ranks.
* ``"full"``: one ordinary checkpoint file written by rank 0, its tensors gathered to
  CPU; the model part loads into a plain module as well.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.checkpoint_io import load_checkpoint_file, save_checkpoint_file
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy
from accord.core.step_module import StepModule
from accord.engines.torch.collective import TorchCollective, default_torch_backend
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import CheckpointError, ConfigurationError
from accord.precision import Precision, PrecisionMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FSDPStrategy", "hybrid_mesh_shape"]

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]
StateDictType = Literal["sharded", "full"]

_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
_STATE_DICT_TYPES = ("sharded", "full")
META_FILE = "accord_meta.pt"
"""The file inside a sharded checkpoint directory that holds the non-tensor state."""


class FSDPStrategy(ParallelStrategy):
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
        state_dict_type: ``"sharded"`` or ``"full"``: how checkpoints are written (see the
            module docstring). Loading accepts both kinds.
        process_group_backend: ``"gloo"``, ``"nccl"`` or ``"mpi"`` (default: nccl on CUDA,
            gloo otherwise) for the default `TorchCollective`.
        timeout: seconds a collective may wait for the other ranks.
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes:
            as `ParallelStrategy`.

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
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        *,
        auto_wrap_policy: set[type[nn.Module]] | None = None,
        min_num_params: int = 100_000,
        cpu_offload: bool = False,
        sharding_strategy: ShardingStrategy = "FULL_SHARD",
        hybrid_shard_size: int | None = None,
        state_dict_type: StateDictType = "sharded",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes
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
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.device_mesh: DeviceMesh | None = None
        self._model: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    @override
    def default_collective(self) -> Collective:
        backend = self.process_group_backend or default_torch_backend(self.root_device)
        return TorchCollective(backend, timeout=self.timeout)

    # ------------------------------------------------------------------ wrapping
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise ConfigurationError(
                f"{type(module).__name__} was already sharded by an earlier FSDP run: its "
                "parameters are DTensors tied to that run's process group. Build a new module "
                "and pass ckpt_path= (a 'full' checkpoint also loads into a plain module)."
            )
        module = super().setup_module(module)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                f"FSDPStrategy shards the model with torch.distributed, but "
                f"{type(self.collective).__name__} did not create or join a process group. "
                "Use a collective built on TorchCollective."
            )
        self.device_mesh = self._build_mesh()
        kwargs = self._fully_shard_kwargs(self.device_mesh)
        root = StepModule(module)
        # FSDP2 units are built bottom-up: children before the modules that hold them.
        for unit in self._units(module):
            fully_shard(unit, **kwargs)
        fully_shard(root, **kwargs)
        self._model = root
        self._optimizers = []
        return root

    def _build_mesh(self) -> DeviceMesh:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        device_type = self.root_device.type
        world_size = self.world_size
        if self.sharding_strategy == "HYBRID_SHARD":
            shape = hybrid_mesh_shape(world_size, self.hybrid_shard_size or self.num_processes)
            return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        group = getattr(self.collective, "group", None)
        if group is not None:
            return DeviceMesh.from_group(group, device_type)
        return init_device_mesh(device_type, (world_size,))

    def _fully_shard_kwargs(self, mesh: DeviceMesh) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        low = {PrecisionMode.BF16_MIXED: torch.bfloat16, PrecisionMode.FP16_MIXED: torch.float16}
        param_dtype = low.get(self.precision.mode)
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            if param_dtype is not None
            else MixedPrecisionPolicy()
        )
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy()
        )
        kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
        if self.sharding_strategy == "SHARD_GRAD_OP":
            kwargs["reshard_after_forward"] = False
        # Otherwise FSDP's default: reshard after forward, except the root, whose
        # parameters backward needs first anyway.
        return kwargs

    def _units(self, module: nn.Module) -> list[nn.Module]:
        """The submodules of ``module`` to shard individually, children before parents."""
        units: list[nn.Module] = []

        def visit(current: nn.Module) -> int:
            # Returns how many parameters below ``current`` are not in a unit yet.
            pending = sum(visit(child) for child in current.children())
            pending += sum(p.numel() for p in current.parameters(recurse=False))
            if current is module:
                return pending
            if self.auto_wrap_policy is not None:
                chosen = isinstance(current, tuple(self.auto_wrap_policy))
            else:
                chosen = pending >= self.min_num_params
            if chosen and any(True for _ in current.parameters()):
                units.append(current)
                return 0
            return pending

        visit(module)
        return units

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        # Kept for the checkpoint methods, whose signatures do not carry the model.
        self._optimizers = list(optimizers)
        return optimizers

    def reshard(self) -> None:
        """Free gathered parameters and register the sharded ones on the module again.

        The root unit keeps its gathered parameters after a forward (backward needs them
        first), and with ``SHARD_GRAD_OP`` every unit does; after an evaluation forward
        no backward reshards them. State-dict methods and teardown call this first, so
        parameters are the same DTensors the optimizer holds.
        """
        from torch.distributed.fsdp import FSDPModule

        if self._model is not None:
            for module in self._model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

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
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        self.precision.unscale_gradients(optimizer)
        # On sharded (DTensor) gradients the norm is computed over every rank's shards.
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, StepModule) else module

    # --------------------------------------------------------------- checkpoints
    @staticmethod
    def _get_options(full: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A full state dict is gathered to rank 0's CPU only; the others get an empty one.
        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    @staticmethod
    def _set_options(state: dict[str, Any], strict: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Every rank holds what it loads: its own shards, or a copy of the full file.
        return StateDictOptions(full_state_dict=not _is_sharded(state), strict=strict)

    def _require_model(self) -> nn.Module:
        if self._model is None:
            raise ConfigurationError("FSDPStrategy has no model yet: call setup_module first.")
        self.reshard()
        return self.unwrap(self._model)

    @override
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The user's module's state (collective: every rank must call it).

        DTensor shards for ``state_dict_type="sharded"``; the gathered full tensors on
        rank 0 (empty on the others) for ``"full"``.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = self.state_dict_type == "full"
        self.reshard()
        return get_model_state_dict(self.unwrap(module), options=self._get_options(full))

    @override
    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        """Load a sharded (DTensor) or a full state dict into the user's module."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        options = self._set_options(state, strict)
        self.reshard()
        set_model_state_dict(self.unwrap(module), state, options=options)

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (collective, like the model's)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full = self.state_dict_type == "full"
        state = get_optimizer_state_dict(
            self._require_model(), optimizer, options=self._get_options(full)
        )
        return dict(state)

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what `optimizer_state_dict` returned, from a checkpoint of either kind.

        A plain ``optimizer.state_dict()`` (parameters numbered, as DDP or one device save
        it) is accepted too: the numbers are matched to names by the optimizer's order.
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = self._require_model()
        state = _name_parameters(state, optimizer, model)
        set_optimizer_state_dict(model, optimizer, state, options=self._set_options(state))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write ``checkpoint`` to ``path``: a directory (sharded) or a file (full).

        Every rank must call it. The checkpoint is written beside ``path`` under a
        temporary name and renamed into place, so a crash leaves the previous one intact.
        """
        if self.state_dict_type == "full":
            if self.is_global_zero and Path(path).is_dir():
                _remove(Path(path))  # a sharded checkpoint of the same name
            super().save_checkpoint(checkpoint, path)
            return
        from torch.distributed.checkpoint.state_dict_saver import save

        target = Path(path)
        staging = target.with_name(f".{target.name}.tmp")
        tensors: dict[str, Any] = {"model": checkpoint["state_dict"]}
        optimizer_states = checkpoint.get("optimizer_states", [])
        for index, state in enumerate(optimizer_states):
            tensors[f"optimizer_{index}"] = state
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["fsdp_sharded"] = {
            "optimizer_count": len(optimizer_states),
            "world_size": self.world_size,
        }
        if self.is_global_zero:
            _remove(staging)  # left over from a run that crashed mid-save
        self.barrier("fsdp_save_checkpoint_start")
        save(tensors, checkpoint_id=staging, process_group=self._group())
        if self.is_global_zero:
            save_checkpoint_file(meta, staging / META_FILE)
            _replace(staging, target)
        self.barrier("fsdp_save_checkpoint")

    @override
    def load_checkpoint(self, path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
        """Read a checkpoint of either kind (collective for a sharded one).

        A sharded checkpoint is read into this run's shards, whatever the number of ranks
        that wrote it; its ``state_dict`` and ``optimizer_states`` hold DTensors.
        """
        source = Path(path)
        if not source.is_dir():
            return load_checkpoint_file(source, weights_only=weights_only)
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load

        if not (source / META_FILE).is_file():
            raise CheckpointError(
                f"{str(source)!r} is a directory without {META_FILE}: not a sharded accord "
                "checkpoint (or one whose save did not finish)."
            )
        checkpoint = load_checkpoint_file(source / META_FILE, weights_only=weights_only)
        model = self._require_model()
        options = self._get_options(full=False)
        # DCP loads in place into tensors shaped like this run's shards.
        tensors: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
        count = int(checkpoint.get("fsdp_sharded", {}).get("optimizer_count", 0))
        loadable = self._optimizers if count == len(self._optimizers) else []
        for index, optimizer in enumerate(loadable):
            tensors[f"optimizer_{index}"] = dict(
                get_optimizer_state_dict(model, optimizer, options=options)
            )
        load(tensors, checkpoint_id=source, process_group=self._group())
        checkpoint["state_dict"] = tensors["model"]
        # On a count mismatch the Trainer reports it; the placeholders are never loaded.
        checkpoint["optimizer_states"] = [
            tensors.get(f"optimizer_{index}", {}) for index in range(count)
        ]
        return checkpoint

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        if self.is_global_zero:
            _remove(Path(path))

    def _group(self) -> Any:
        return getattr(self.collective, "group", None)


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


def _name_parameters(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """``state`` with numbered parameters renamed to ``model``'s parameter names."""
    groups = state.get("param_groups", [])
    if not groups or all(isinstance(i, str) for g in groups for i in g["params"]):
        return state
    names = {id(p): name for name, p in model.named_parameters()}
    # optimizer.state_dict() numbers the parameters in the order of its param_groups.
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in groups):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {sum(len(g['params']) for g in groups)} "
            f"parameters, but this optimizer has {len(order)}."
        )
    return {
        "state": {order[int(i)]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in groups],
    }


def _is_sharded(state: Any) -> bool:
    """Whether a (nested) state dict holds DTensors: one loaded from a sharded checkpoint."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(_is_sharded(value) for value in state.values())
    if isinstance(state, list | tuple):
        return any(_is_sharded(value) for value in state)
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _replace(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``, replacing a file or directory already there."""
    if not target.exists():
        source.rename(target)
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first.
    old = target.with_name(f".{target.name}.old")
    _remove(old)
    target.rename(old)
    source.rename(target)
    _remove(old)
