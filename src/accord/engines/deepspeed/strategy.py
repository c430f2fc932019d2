"""`DeepSpeedStrategy`: data parallel training with a DeepSpeed engine and ZeRO stages 1-3.

DeepSpeed is imported only when a run starts (``setup_module``), so ``import accord`` and
building the registry never import it. Building the strategy without DeepSpeed installed
raises `MissingDependencyError`, which says how to install it.

How the Trainer's loop maps onto the engine:

- the model is wrapped in a `StepModule` and handed to ``deepspeed.initialize`` together
  with the optimizer from ``configure_optimizers`` (unless the config names its own), so
  every step hook runs through the engine's ``forward`` (ZeRO-3 gathers parameters there);
- gradient accumulation: the Trainer already divides the loss by
  ``accumulate_grad_batches`` and says, through `no_backward_sync`, whether a batch ends an
  accumulation window. The strategy writes ``gradient_accumulation_steps`` into the config,
  tells the engine where every window ends (``set_gradient_accumulation_boundary``), calls
  ``engine.backward(loss, scale_wrt_gas=False)`` (no second division), and
  ``engine.step()`` once per window — so a short last window of an epoch steps too, as on
  every other strategy;
- gradient clipping: ``Trainer(gradient_clip_val=...)`` becomes the config's
  ``gradient_clipping``, applied inside ``engine.step()``;
- precision: ``"16-mixed"`` and ``"16-true"`` enable DeepSpeed's ``fp16`` (CUDA only),
  ``"bf16-mixed"`` and ``"bf16-true"`` its ``bf16``; the engine casts the model and keeps
  fp32 master weights, and the strategy casts floating-point batch tensors to the model's
  dtype;
- checkpoints: ``engine.save_checkpoint`` writes one directory per checkpoint (every rank
  its own shard); the Trainer's other state (loop position, callbacks, schedulers, RNG)
  travels as the engine's client state. A save writes a tag directory the checkpoint's
  ``latest`` file does not name and replaces ``latest`` only when every rank is done, so
  a crash mid-save leaves the previous checkpoint whole. `consolidate_deepspeed_checkpoint`
  turns such a directory into a plain state dict file.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.checkpoint_io import save_checkpoint_file, write_bytes_atomically
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy, StartMethod
from accord.core.step_module import StepModule
from accord.engines.deepspeed.collective import DeepSpeedCollective
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import CheckpointError, ConfigurationError, MissingDependencyError
from accord.precision import Precision, PrecisionMode

__all__ = ["DeepSpeedPrecision", "DeepSpeedStrategy", "consolidate_deepspeed_checkpoint"]


_STAGES = (1, 2, 3)
_TAGS = ("checkpoint-0", "checkpoint-1")
"""The tags a checkpoint directory's saves take in turn (``<dir>/<tag>/`` holds the files)."""
_CLIENT_KEY = "accord"
"""The key of the Trainer's state inside the engine's client state."""
_STEP_PREFIX = "module."
"""What `StepModule` puts before the user's parameter names."""


def _missing() -> MissingDependencyError:
    return MissingDependencyError("DeepSpeedStrategy", "deepspeed", "deepspeed")


def _import(name: str) -> ModuleType:
    """Import ``name`` (deepspeed or one of its modules), or say how to install deepspeed."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise _missing() from err


class _FromEngine(dict[str, Any]):
    """An empty placeholder for state the DeepSpeed engine saves or restores itself."""


class DeepSpeedPrecision(Precision):
    """The Trainer's precision under DeepSpeed: the engine casts and scales, not torch.amp.

    There is no autocast and no `torch.amp.GradScaler` (DeepSpeed's fp16 mode scales the
    loss itself); `deepspeed_config` gives the config entries for the mode, and
    `convert_input` casts floating-point batch tensors to the dtype the engine gives the
    model.

    Args:
        mode, device: as `Precision`.
    """

    def __init__(self, mode: str | int | PrecisionMode = "32-true", device: Any = "cpu") -> None:
        super().__init__(mode, device)
        self.scaler = None

    @property
    @override
    def input_dtype(self) -> torch.dtype | None:
        """The dtype the engine's model computes in, or None for fp32.

        The engine casts the model in the mixed modes too, so their batches are cast as
        well (`convert_input`, inherited, called from ``Strategy.batch_to_device``).
        """
        return {
            PrecisionMode.FP16_MIXED: torch.float16,
            PrecisionMode.BF16_MIXED: torch.bfloat16,
            PrecisionMode.BF16_TRUE: torch.bfloat16,
            PrecisionMode.FP16_TRUE: torch.float16,
        }.get(self.mode)

    @property
    def config_key(self) -> str | None:
        """``"fp16"``, ``"bf16"``, or None: the DeepSpeed config section this mode enables."""
        dtype = self.input_dtype
        if dtype is None:
            return None
        return "fp16" if dtype == torch.float16 else "bf16"

    def deepspeed_config(self) -> dict[str, Any]:
        """The config entries that select this precision in DeepSpeed."""
        key = self.config_key
        return {key: {"enabled": True}} if key is not None else {}

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # the engine casts the parameters

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Any:
        yield

    @override
    def __repr__(self) -> str:
        return f"DeepSpeedPrecision({self.mode.value!r})"


class DeepSpeedStrategy(ParallelStrategy):
    """Data parallel training through a DeepSpeed engine, with ZeRO stage 1, 2 or 3.

    The collective is a `DeepSpeedCollective` (``deepspeed.comm``). Processes start as
    under ``ddp``: the script is re-run for each local rank (``start_method="popen"``) or
    the ranks are spawned/forked; under torchrun or SLURM nothing is started.

    Args:
        stage: the ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also
            parameters (default 2).
        offload_optimizer: keep optimizer states (and the step) on the CPU.
        offload_parameters: keep parameters on the CPU between uses (stage 3 only).
        config: a complete DeepSpeed config, as a dict or the path of a JSON file. Pass
            either ``config`` or ``stage``/``offload_*``/keyword entries, not both.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``, as `DDPStrategy`.
        process_group_backend: the torch.distributed backend under deepspeed.comm
            (default: gloo on CPU, the accelerator's own otherwise).
        timeout: seconds a collective may wait for the other ranks.
        **config_entries: more top-level DeepSpeed config entries, e.g.
            ``optimizer={"type": "Adam", "params": {"lr": 1e-3}}`` or
            ``zero_optimization={"overlap_comm": False}`` (merged with ``stage``).
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes, debug:
            as `ParallelStrategy`.

    The strategy fills in what the Trainer decides: ``gradient_accumulation_steps``
    (``accumulate_grad_batches``), ``gradient_clipping`` (``gradient_clip_val``),
    ``fp16``/``bf16`` (``precision``) and, when the config does not set a batch size,
    ``train_micro_batch_size_per_gpu: 1`` (DeepSpeed only uses it for reporting here). A
    config that contradicts the Trainer raises `ConfigurationError`.

    The optimizer from ``configure_optimizers`` is used unless the config names one
    (``zero_allow_untested_optimizer`` is set for it). When the config names one,
    DeepSpeed builds it from the model's parameters, and LR schedulers returned by
    ``configure_optimizers`` drive nothing: put the scheduler in the config as well. An
    Adam/AdamW the config names gets ``torch_adam: true`` on CPU (DeepSpeed's fused Adam
    needs CUDA).

    Raises:
        MissingDependencyError: deepspeed is not installed.
        ConfigurationError: invalid options.
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
        stage: int | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: dict[str, Any] | str | Path | None = None,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        debug: bool = False,
        **config_entries: Any,
    ) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise _missing()
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            collective,
            precision,
            num_nodes,
            start_method=start_method,
            debug=debug,
        )
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.config = _build_config(
            stage, offload_optimizer, offload_parameters, config, config_entries
        )
        self.engine_config: dict[str, Any] | None = None
        """The config the current engine was built with (None before a run)."""
        self._engine: Any = None
        self._step_module: StepModule | None = None
        self._trains = False

    # ---------------------------------------------------------------- options
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (1, 2 or 3)."""
        return int(self.config["zero_optimization"]["stage"])

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` of the current run (None outside a run)."""
        return self._engine

    @property
    def precision(self) -> DeepSpeedPrecision:
        """The `DeepSpeedPrecision`; any `Precision` assigned is converted to one."""
        return self._precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        if not isinstance(precision, DeepSpeedPrecision):
            precision = DeepSpeedPrecision(precision.mode, precision.device_type)
        self._precision = precision

    @override
    def default_collective(self) -> Collective:
        return DeepSpeedCollective(self.process_group_backend, timeout=self.timeout)

    # ------------------------------------------------------------- the engine
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._release_engine(gather=False)
        module = super().setup_module(module)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "DeepSpeed runs on a torch.distributed process group, but "
                f"{type(self.collective).__name__} did not create or join one. Use "
                "DeepSpeedCollective or a collective built on TorchCollective."
            )
        self._step_module = StepModule(module)
        return self._step_module

    @override
    def setup_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Build the engine around the model and the optimizer; return the engine's optimizer."""
        if len(optimizers) != 1:
            raise ConfigurationError(
                f"DeepSpeedStrategy trains with exactly one optimizer, but "
                f"configure_optimizers() returned {len(optimizers)}."
            )
        engine = self._init_engine(optimizers[0])
        return [cast(torch.optim.Optimizer, engine.optimizer)]

    def _init_engine(self, optimizer: torch.optim.Optimizer | None) -> Any:
        """``deepspeed.initialize`` for training (with ``optimizer``) or evaluation (None)."""
        if self._step_module is None:
            raise ConfigurationError("setup_module() must run before the DeepSpeed engine starts.")
        deepspeed = _import("deepspeed")
        trains = optimizer is not None
        config = self._training_config() if trains else self._evaluation_config()
        kwargs: dict[str, Any] = {}
        if trains:
            if "optimizer" in config:
                params = [p for p in self._step_module.parameters() if p.requires_grad]
                kwargs["model_parameters"] = params
            else:
                kwargs["optimizer"] = optimizer
        self.engine_config = config
        engine, *_ = deepspeed.initialize(
            model=self._step_module,
            config=copy.deepcopy(config),
            dist_init_required=False,
            **kwargs,
        )
        self._engine = engine
        self._trains = trains
        return engine

    def _ensure_engine(self) -> Any:
        return self._engine if self._engine is not None else self._init_engine(None)

    def _training_config(self) -> dict[str, Any]:
        config = copy.deepcopy(self.config)
        accumulate = self.run_settings.accumulate_grad_batches
        clip = self.run_settings.gradient_clip_val
        if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
            config["train_micro_batch_size_per_gpu"] = 1
        steps = config.get("gradient_accumulation_steps")
        if steps is not None and int(steps) != accumulate:
            raise ConfigurationError(
                f"The DeepSpeed config sets gradient_accumulation_steps={steps} but the Trainer "
                f"accumulates {accumulate} batch(es). Set Trainer(accumulate_grad_batches=...) "
                "and leave gradient_accumulation_steps out of the config."
            )
        config["gradient_accumulation_steps"] = accumulate
        if clip is not None:
            configured = config.get("gradient_clipping")
            if configured not in (None, 0, 0.0) and float(configured) != float(clip):
                raise ConfigurationError(
                    f"The DeepSpeed config sets gradient_clipping={configured} but the Trainer "
                    f"has gradient_clip_val={clip}. Set one of them only."
                )
            config["gradient_clipping"] = float(clip)
        else:
            # DeepSpeed clips to 1.0 when the config is silent; the Trainer asked for none.
            config.setdefault("gradient_clipping", 0.0)
        self._apply_precision(config)
        zero = config["zero_optimization"]
        offloads = zero.get("offload_optimizer", {}).get("device", "none") not in (None, "none")
        if "optimizer" in config:
            optimizer = config["optimizer"]
            kind = str(optimizer.get("type", "")).lower()
            if kind in ("adam", "adamw") and self.root_device.type == "cpu":
                optimizer.setdefault("params", {}).setdefault("torch_adam", True)
        else:
            config.setdefault("zero_allow_untested_optimizer", True)
            if offloads:
                # A client optimizer steps the offloaded fp32 partition on the CPU.
                config.setdefault("zero_force_ds_cpu_optimizer", False)
        return config

    def _evaluation_config(self) -> dict[str, Any]:
        """An engine without an optimizer: ZeRO only where it shards parameters (stage 3)."""
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.config.get("train_micro_batch_size_per_gpu", 1)
        }
        for key in ("fp16", "bf16", "steps_per_print", "wall_clock_breakdown"):
            if key in self.config:
                config[key] = copy.deepcopy(self.config[key])
        if self.zero_stage == 3:
            config["zero_optimization"] = copy.deepcopy(self.config["zero_optimization"])
        self._apply_precision(config)
        return config

    def _apply_precision(self, config: dict[str, Any]) -> None:
        wanted = self.precision.config_key
        for key in ("fp16", "bf16"):
            enabled = bool(config.get(key, {}).get("enabled", False))
            if enabled and key != wanted:
                raise ConfigurationError(
                    f"The DeepSpeed config enables {key!r} but the Trainer's precision is "
                    f"{self.precision.mode.value!r}. Pass "
                    f"precision={'16-mixed' if key == 'fp16' else 'bf16-mixed'!r} to the Trainer "
                    "(or remove the entry from the config)."
                )
        if wanted is not None:
            config.setdefault(wanted, {})["enabled"] = True

    # ------------------------------------------------------------ training step
    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        return self._ensure_engine()(name, *args)

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Tell the engine whether this batch ends an accumulation window (``not enabled``)."""
        if self._engine is not None and self._trains:
            self._engine.set_gradient_accumulation_boundary(not enabled)
        return contextlib.nullcontext()

    @override
    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        """``engine.backward``; the Trainer already divided the loss for accumulation."""
        self._require_training("backward")
        self._engine.backward(loss, scale_wrt_gas=False)

    @override
    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """DeepSpeed clips inside ``engine.step()`` (config ``gradient_clipping``).

        Returns NaN: the norm is only known after the step (``engine.get_global_grad_norm()``).

        Raises:
            ConfigurationError: ``max_norm`` is not the value the engine was built with.
        """
        self._require_training("clip_gradients")
        configured = float(self._engine.gradient_clipping())
        if configured != float(max_norm):
            raise ConfigurationError(
                f"The DeepSpeed engine clips gradients to {configured}, set when it was built; "
                f"it cannot clip to {max_norm} now. Set gradient_clip_val before fit()."
            )
        return torch.tensor(float("nan"))

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """``engine.step()``: reduce the window's gradients, clip, step, zero the gradients."""
        self._require_training("optimizer_step")
        self._engine.step()

    @override
    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """Nothing to do: ``engine.step()`` already cleared the gradients."""

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        target: Any = module
        if self._engine is not None and target is self._engine:
            target = self._engine.module
        if isinstance(target, StepModule):
            target = target.module
        return cast(nn.Module, target)

    def _require_training(self, what: str) -> None:
        if self._engine is None or not self._trains:
            raise ConfigurationError(
                f"DeepSpeedStrategy.{what}() needs the training engine; it is built by "
                "setup_optimizers() during fit()."
            )

    # --------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        # After an error on some rank the others may never join a gather: skip it then.
        self._release_engine(gather=sys.exc_info()[0] is None)
        super().teardown()

    def _release_engine(self, gather: bool) -> None:
        """Drop the engine; under ZeRO-3 first put the full weights back into the model.

        ZeRO-3 leaves every parameter partitioned (empty on each rank). With ``gather``,
        each module's parameters are gathered and replaced by plain full parameters, so
        after ``fit`` the model holds the trained weights (as under every other strategy);
        every rank must take part.
        """
        engine, self._engine = self._engine, None
        if engine is None:
            return
        step_module = self._step_module
        if gather and self.zero_stage == 3 and step_module is not None:
            _materialize_zero3_parameters(step_module.module)
        engine.destroy()
        self._trains = False

    # --------------------------------------------------------------- checkpoints
    @override
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The user's full state dict.

        Under ZeRO-3 the parameters are gathered one module at a time (every rank must
        call this) and only global rank 0 receives them; the other ranks get ``{}``.
        """
        engine = self._engine
        if engine is None or self.zero_stage != 3:
            return self.unwrap(module).state_dict()
        state = engine._zero3_consolidated_16bit_state_dict()
        if state is None:
            return {}
        return _strip_step_prefix(state)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        """Load a full state dict into the model (and the engine's fp32 master weights).

        Every rank must call this under ZeRO-3. The placeholder that `load_checkpoint`
        returns for a DeepSpeed checkpoint is skipped: the engine restored those weights.
        """
        if isinstance(state, _FromEngine):
            return
        target = self.unwrap(module)
        engine = self._engine
        if engine is None:
            target.load_state_dict(state, strict=strict)
            return
        if self.zero_stage == 3:
            deepspeed = _import("deepspeed")
            with deepspeed.zero.GatheredParameters(list(target.parameters()), modifier_rank=0):
                target.load_state_dict(state, strict=strict)
        else:
            target.load_state_dict(state, strict=strict)
        refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """An empty placeholder: the engine writes its (sharded) optimizer state itself."""
        return _FromEngine()

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Accept the placeholder of a DeepSpeed checkpoint (the engine restored the state).

        Raises:
            CheckpointError: ``state`` is another strategy's optimizer state.
        """
        if isinstance(state, _FromEngine):
            return
        raise CheckpointError(
            "This checkpoint was not written by DeepSpeedStrategy: its optimizer state cannot "
            "be loaded into a DeepSpeed engine. Resume from a DeepSpeed checkpoint, or load "
            "only the weights (model.load_state_dict) before fit()."
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write a checkpoint directory with ``engine.save_checkpoint`` (every rank must call it).

        Each rank writes its shard of the model and optimizer states under
        ``<path>/<tag>/``; the rest of ``checkpoint`` (everything but ``state_dict``
        and ``optimizer_states``) is stored as the engine's client state. The tag is the
        one of ``checkpoint-0`` and ``checkpoint-1`` that ``<path>/latest`` does not name;
        ``latest`` is replaced (atomically) after every rank has written its shard, and
        only then is the previous tag deleted, so a crash mid-save leaves the previous
        checkpoint loadable. Outside training (no engine with an optimizer) the checkpoint
        is one file, as in `Strategy`.
        """
        if self._engine is None or not self._trains:
            super().save_checkpoint(checkpoint, path)
            return
        client = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        target = Path(path)
        tags: tuple[str | None, str] | None = None
        if self.is_global_zero:
            if target.is_file():
                target.unlink()  # a single-file checkpoint of an earlier evaluation run
            previous = _read_latest(target)
            tags = (previous, _TAGS[1] if previous == _TAGS[0] else _TAGS[0])
        previous, tag = cast(tuple[str | None, str], self.broadcast(tags))
        if self.local_rank == 0:
            shutil.rmtree(target / tag, ignore_errors=True)  # what a crashed save left
        self.barrier("deepspeed_save_checkpoint_prepare")
        self._engine.save_checkpoint(
            str(target), tag=tag, client_state={_CLIENT_KEY: client}, save_latest=False
        )
        self.barrier("deepspeed_save_checkpoint_written")
        if self.is_global_zero:
            write_bytes_atomically(tag.encode(), target / "latest")
            # Rewriting files inside leaves a directory's mtime alone; ckpt_path="last" reads it.
            os.utime(target)
        self.barrier("deepspeed_save_checkpoint_committed")
        if previous is not None and previous != tag and self.local_rank == 0:
            shutil.rmtree(target / previous, ignore_errors=True)
        self.barrier("save_checkpoint")

    @override
    def load_checkpoint(self, path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
        """Read a checkpoint directory written by `save_checkpoint` (or a single file).

        During fit the engine restores its weights and optimizer state itself (every rank
        must call this); the returned ``state_dict`` and ``optimizer_states`` are
        placeholders for that. Otherwise the ZeRO shards are consolidated into a full
        ``state_dict``. DeepSpeed reads its own shard files with pickle, so
        ``weights_only`` applies to single files only.
        """
        source = Path(path)
        if source.is_file():
            return super().load_checkpoint(source, weights_only=weights_only)
        if not source.is_dir():
            raise CheckpointError(
                f"No checkpoint at {str(source)!r}. Check the path, or pass ckpt_path='last' "
                "to resume from the latest checkpoint."
            )
        if self._engine is None or not self._trains:
            state, client = _consolidate(source, None)
            return {**client, "state_dict": state}
        load_path, client = self._engine.load_checkpoint(
            str(source), load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if load_path is None or not isinstance(client, dict):
            raise CheckpointError(
                f"DeepSpeed could not load {str(source)!r} (no 'latest' file or tag directory)."
            )
        if _CLIENT_KEY not in client:
            raise CheckpointError(
                f"{str(source)!r} is a DeepSpeed checkpoint without accord's training state "
                "(loop position, callbacks); it cannot resume a fit. Evaluate from it, or "
                "consolidate it with consolidate_deepspeed_checkpoint() and load the weights."
            )
        checkpoint = dict(client[_CLIENT_KEY])
        checkpoint["state_dict"] = _FromEngine()
        checkpoint["optimizer_states"] = [_FromEngine()]
        return checkpoint

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint directory (or file); local rank 0 of every node deletes."""
        target = Path(path)
        if not target.is_dir():
            super().remove_checkpoint(target)
        elif self.local_rank == 0:
            shutil.rmtree(target, ignore_errors=True)

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(stage={self.zero_stage}, "
            f"collective={type(self.collective).__name__})"
        )


def consolidate_deepspeed_checkpoint(
    checkpoint_dir: str | Path, output_file: str | Path, *, tag: str | None = None
) -> Path:
    """Turn a ZeRO checkpoint directory into one plain fp32 state dict file.

    Works offline, in one process: the shards every rank wrote are merged with DeepSpeed's
    ``zero_to_fp32`` utilities. The file holds the model's state dict (parameter names as
    in the user's module), so ``model.load_state_dict(torch.load(output_file))`` works
    without DeepSpeed.

    Args:
        checkpoint_dir: a directory `DeepSpeedStrategy.save_checkpoint` (or DeepSpeed's
            ``engine.save_checkpoint``) wrote.
        output_file: where to write the state dict (atomically).
        tag: the tag inside ``checkpoint_dir``; default: its ``latest`` file.

    Returns:
        ``output_file`` as a `Path`.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CheckpointError: ``checkpoint_dir`` is not a DeepSpeed checkpoint.
    """
    state, _ = _consolidate(Path(checkpoint_dir), tag)
    return save_checkpoint_file(state, output_file)


# -------------------------------------------------------------------- helpers
def _build_config(
    stage: int | None,
    offload_optimizer: bool,
    offload_parameters: bool,
    config: dict[str, Any] | str | Path | None,
    entries: dict[str, Any],
) -> dict[str, Any]:
    """The DeepSpeed config from ``config`` or from the keyword options."""
    if config is not None:
        if stage is not None or offload_optimizer or offload_parameters or entries:
            raise ConfigurationError(
                "Pass either config= (a complete DeepSpeed config) or stage=/offload_*=/config "
                f"entries, not both (got config and {_given(stage, offload_optimizer, offload_parameters, entries)})."
            )
        result = _read_config(config)
        zero = result.setdefault("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ConfigurationError("The DeepSpeed config's zero_optimization must be a dict.")
        zero.setdefault("stage", 2)
    else:
        zero = dict(entries.pop("zero_optimization", None) or {})
        if stage is not None and "stage" in zero and int(zero["stage"]) != stage:
            raise ConfigurationError(
                f"stage={stage} but zero_optimization sets stage={zero['stage']}; pass one."
            )
        zero["stage"] = stage if stage is not None else int(zero.get("stage", 2))
        if offload_optimizer:
            zero.setdefault("offload_optimizer", {"device": "cpu"})
        if offload_parameters:
            zero.setdefault("offload_param", {"device": "cpu"})
        result = {**copy.deepcopy(entries), "zero_optimization": zero}
    stage_value = zero["stage"]
    if isinstance(stage_value, bool) or stage_value not in _STAGES:
        raise ConfigurationError(
            f"ZeRO stage {stage_value!r} is not supported: use 1, 2 or 3 (for plain data "
            "parallel training use strategy='ddp')."
        )
    if zero.get("offload_param", {}).get("device", "none") not in (None, "none") and (
        stage_value != 3
    ):
        raise ConfigurationError(
            f"offload_parameters needs ZeRO stage 3 (stage is {stage_value}): only stage 3 "
            "shards the parameters."
        )
    return result


def _given(
    stage: int | None, offload_opt: bool, offload_params: bool, entries: dict[str, Any]
) -> str:
    names = [
        name
        for name, value in (
            ("stage", stage is not None),
            ("offload_optimizer", offload_opt),
            ("offload_parameters", offload_params),
        )
        if value
    ]
    return ", ".join([*names, *sorted(entries)])


def _read_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(
            f"DeepSpeed config {str(path)!r} does not exist. Pass a dict or the path of a JSON "
            "file."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigurationError(
            f"DeepSpeed config {str(path)!r} is not valid JSON: {err}"
        ) from err
    if not isinstance(loaded, dict):
        raise ConfigurationError(f"DeepSpeed config {str(path)!r} must hold a JSON object.")
    return loaded


def _strip_step_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Names as in the user's module (drop `StepModule`'s ``module.``)."""
    return {
        (key[len(_STEP_PREFIX) :] if key.startswith(_STEP_PREFIX) else key): value
        for key, value in state.items()
    }


def _read_latest(directory: Path) -> str | None:
    """The tag a checkpoint directory's ``latest`` file names, or None without one."""
    try:
        return (directory / "latest").read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def _checkpoint_tag(directory: Path, tag: str | None) -> str:
    found = tag if tag is not None else _read_latest(directory)
    if found is None:
        raise CheckpointError(
            f"{str(directory)!r} is not a DeepSpeed checkpoint: it has no 'latest' file (a "
            "save that did not finish leaves none). Pass tag= to name the tag directory to read."
        )
    return found


def _model_states_file(directory: Path, tag: str) -> Path:
    files = sorted((directory / tag).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{str(directory / tag)!r} holds no DeepSpeed model states file (*model_states.pt)."
        )
    return files[0]


def _load_model_states(directory: Path, tag: str) -> dict[str, Any]:
    source = _model_states_file(directory, tag)
    try:
        # DeepSpeed's own files hold pickled config objects; DeepSpeed reads them so too.
        loaded = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{str(source)!r} is not readable: {err}") from err
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{str(source)!r} holds a {type(loaded).__name__}, not a dict.")
    return loaded


def _consolidate(directory: Path, tag: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ZeRO checkpoint's full fp32 state dict and the Trainer state stored beside it.

    The state dict has the user's parameter names when accord wrote the checkpoint; the
    Trainer state is empty for a checkpoint DeepSpeed wrote for someone else.
    """
    if not directory.is_dir():
        raise CheckpointError(f"{str(directory)!r} is not a DeepSpeed checkpoint directory.")
    tag = _checkpoint_tag(directory, tag)
    zero_to_fp32 = _import("deepspeed.utils.zero_to_fp32")
    try:
        state = dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag))
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{str(directory)!r} could not be consolidated (not a ZeRO checkpoint?): {err}"
        ) from err
    states = _load_model_states(directory, tag)
    if _CLIENT_KEY not in states:
        return state, {}
    return _strip_step_prefix(state), dict(states[_CLIENT_KEY])


def _materialize_zero3_parameters(module: nn.Module) -> None:
    """Replace ZeRO-3's partitioned parameters with plain full ones (every rank at once).

    Tied parameters stay tied: each partitioned parameter becomes one new parameter.
    """
    deepspeed = _import("deepspeed")
    replaced: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        own = [(name, p) for name, p in submodule._parameters.items() if p is not None]
        pending = list({id(p): p for _, p in own if id(p) not in replaced}.values())
        if pending:
            with deepspeed.zero.GatheredParameters(pending, modifier_rank=None):
                for param in pending:
                    replaced[id(param)] = nn.Parameter(
                        param.data.detach().clone(), requires_grad=param.requires_grad
                    )
        for name, param in own:
            setattr(submodule, name, replaced[id(param)])
