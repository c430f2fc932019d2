"""`_FSDPCheckpoints`: the part of `FSDPStrategy` that reads and writes the sharded state.

A base class of `FSDPStrategy` (`accord.engines.torch.fsdp`) holding `reshard`, `unwrap`,
the model's and the optimizers' state dicts and the checkpoint methods (sharded
directories or full files, `accord.engines.torch.fsdp_checkpoint_directory`).
`FSDPStrategy` sets the attributes it reads when it wraps the module and its optimizers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from typing_extensions import override

from accord.checkpoint.compiled_names import plain_names
from accord.checkpoint.formats import checkpoint_format
from accord.checkpoint.reading import read_checkpoint
from accord.checkpoint.writing import remove_checkpoint_path
from accord.core.parallel import ParallelStrategy
from accord.core.step_module import StepModule
from accord.engines.torch.collective import TorchCollective
from accord.engines.torch.fsdp_checkpoint_directory import (
    load_options,
    load_sharded,
    name_parameters,
    save_sharded,
    state_dict_options,
)
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

StateDictType = Literal["sharded", "full"]


class _FSDPCheckpoints(ParallelStrategy):
    """`FSDPStrategy`'s state dicts and checkpoints, on the model it sharded."""

    state_dict_type: StateDictType
    _model: nn.Module | None
    _optimizers: list[torch.optim.Optimizer]

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
    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, StepModule) else module

    # --------------------------------------------------------------- checkpoints
    def _require_model(self) -> nn.Module:
        if self._model is None:
            raise ConfigurationError("FSDPStrategy has no model yet: call setup_module first.")
        self.reshard()
        return self.unwrap(self._model)

    @property
    def process_group(self) -> ProcessGroup:
        """The process group FSDP shards over and checkpoints on: the collective's."""
        return self.engine_collective(TorchCollective).process_group

    @override
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The user's module's state (collective: every rank must call it).

        DTensor shards for ``state_dict_type="sharded"``; the gathered full tensors on
        rank 0 (empty on the others) for ``"full"``.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.reshard()
        options = state_dict_options(full=self.state_dict_type == "full")
        return get_model_state_dict(self.unwrap(module), options=options)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True
    ) -> None:
        """Load a sharded (DTensor) or a full state dict into the user's module.

        ``torch.distributed.checkpoint`` matches plain names to the module's own, so
        ``torch.compile``'d parts load from the plain names checkpoints hold.
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        self.reshard()
        state = plain_names(state)
        set_model_state_dict(self.unwrap(module), state, options=load_options(state, strict))

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (collective, like the model's)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        options = state_dict_options(full=self.state_dict_type == "full")
        return dict(get_optimizer_state_dict(self._require_model(), optimizer, options=options))

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
        state = name_parameters(state, optimizer, model)
        set_optimizer_state_dict(model, optimizer, state, options=load_options(state))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write ``checkpoint`` to ``path``: a directory (sharded) or a file (full).

        Every rank must call it. The checkpoint is written beside ``path`` under a
        temporary name and renamed into place, so a crash leaves the previous one intact.
        """
        if self.state_dict_type == "full":
            if self.is_global_zero and Path(path).is_dir():
                remove_checkpoint_path(path)  # a sharded checkpoint of the same name
            super().save_checkpoint(checkpoint, path)
            return
        save_sharded(self, checkpoint, Path(path), self.process_group)

    @override
    def load_checkpoint(self, path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
        """Read a checkpoint of either kind (collective for a sharded one).

        A sharded checkpoint is read into this run's shards, whatever the number of ranks
        that wrote it; its ``state_dict`` and ``optimizer_states`` hold DTensors. A file, or
        another strategy's directory, is read whole (`accord.checkpoint.read_checkpoint`).
        """
        source = Path(path)
        if checkpoint_format(source) != "fsdp_sharded":
            return read_checkpoint(source, weights_only=weights_only)
        return load_sharded(
            source,
            self._require_model(),
            self._optimizers,
            self.process_group,
            weights_only=weights_only,
        )

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(path)
