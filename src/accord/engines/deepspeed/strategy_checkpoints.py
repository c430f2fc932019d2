"""`DeepSpeedCheckpoints`: the checkpoint methods `DeepSpeedStrategy` inherits.

Module and optimizer state dicts (full under ZeRO-3 through `accord.engines.deepspeed.zero3`,
`EngineState` placeholders where the engine keeps the state itself), and saving, loading
and removing checkpoint directories through `accord.engines.deepspeed.checkpoint_directory`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from accord.checkpoint.compiled_names import module_names
from accord.checkpoint.writing import remove_checkpoint_path
from accord.core.parallel import ParallelStrategy
from accord.engines.deepspeed import zero3
from accord.engines.deepspeed.checkpoint_directory import (
    EngineState,
    load_for_engine,
    save_engine_checkpoint,
)
from accord.errors import CheckpointError

__all__ = ["DeepSpeedCheckpoints"]


class DeepSpeedCheckpoints(ParallelStrategy):
    """The checkpoint methods of `DeepSpeedStrategy`, which sets ``_engine`` and ``_trains``."""

    _engine: Any
    """The DeepSpeed engine (None outside a run)."""
    _trains: bool
    """Whether the engine is the training one (built by ``setup_optimizers``)."""

    if TYPE_CHECKING:

        @property
        def zero_stage(self) -> int: ...

    @override
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The user's full state dict.

        Under ZeRO-3 the parameters are gathered one module at a time (every rank must
        call this) and only global rank 0 receives them; the other ranks get ``{}``.
        """
        if self._engine is None or self.zero_stage != 3:
            return self.unwrap(module).state_dict()
        return zero3.full_state_dict(self._engine)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        """Load a full state dict into the model (and the engine's fp32 master weights).

        Every rank must call this under ZeRO-3. The placeholder that `load_checkpoint`
        returns for a DeepSpeed checkpoint is skipped: the engine restored those weights.
        Names are matched to the module's own, ``torch.compile``'d parts or not
        (`accord.checkpoint.compiled_names.module_names`).
        """
        if isinstance(state, EngineState):
            return
        target = self.unwrap(module)
        state = module_names(target, state)
        if self._engine is not None and self.zero_stage == 3:
            zero3.load_full_state_dict(target, state, strict)
        else:
            target.load_state_dict(state, strict=strict)
        refresh = getattr(getattr(self._engine, "optimizer", None), "refresh_fp32_params", None)
        if callable(refresh):
            refresh()  # the engine's fp32 master weights follow the loaded ones

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """An empty placeholder: the engine writes its (sharded) optimizer state itself."""
        return EngineState()

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Accept the placeholder of a DeepSpeed checkpoint (the engine restored the state).

        Raises:
            CheckpointError: ``state`` is another strategy's optimizer state.
        """
        if isinstance(state, EngineState):
            return
        raise CheckpointError(
            "This checkpoint was not written by DeepSpeedStrategy: its optimizer state cannot "
            "be loaded into a DeepSpeed engine. Resume from a DeepSpeed checkpoint, or load "
            "only the weights (model.load_state_dict) before fit()."
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write a checkpoint directory with ``engine.save_checkpoint`` (every rank must call it).

        Each rank writes its shards; the rest of ``checkpoint`` travels as the engine's
        client state, and a crash mid-save leaves the previous checkpoint loadable (see
        `save_engine_checkpoint`). Outside training the checkpoint is one file, as in
        `Strategy`.
        """
        if self._engine is None or not self._trains:
            super().save_checkpoint(checkpoint, path)
            return
        save_engine_checkpoint(self, self._engine, checkpoint, Path(path))
        self.barrier("save_checkpoint")

    @override
    def load_checkpoint(self, path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
        """Read any strategy's checkpoint: a file, or a directory FSDP or DeepSpeed wrote.

        During fit (every rank must call this) a DeepSpeed checkpoint of this ZeRO stage and
        world size is restored by the engine itself, and the returned ``state_dict`` and
        ``optimizer_states`` are placeholders for that; any other checkpoint is read whole
        and its optimizer state put into the ZeRO-1/2 partitions
        (`accord.engines.deepspeed.checkpoint_directory.load_for_engine`). Otherwise the ZeRO shards
        are consolidated into a full ``state_dict``. With ``weights_only``, DeepSpeed's
        shards too are read without running code.
        """
        engine = self._engine if self._trains else None
        return load_for_engine(Path(path), engine, self.global_rank, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint directory (or file); local rank 0 of every node deletes."""
        target = Path(path)
        if not target.is_dir():
            super().remove_checkpoint(target)
        elif self.local_rank == 0:
            remove_checkpoint_path(target)
