"""Strategy names → factories, so ``Trainer(strategy="ddp")`` works and users can add names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from accord.core.strategy import Strategy
from accord.errors import ConfigurationError, did_you_mean

__all__ = ["StrategyEntry", "StrategyRegistry"]


@dataclass(frozen=True)
class StrategyEntry:
    """One registered name: the class to build and the keyword arguments it is built with."""

    name: str
    strategy_cls: Callable[..., Strategy]
    description: str
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, **overrides: Any) -> Strategy:
        """A new strategy from this entry; ``overrides`` win over the registered kwargs."""
        return self.strategy_cls(**{**self.init_kwargs, **overrides})


class _Registry:
    """The registry behind `StrategyRegistry`."""

    def __init__(self) -> None:
        self._entries: dict[str, StrategyEntry] = {}

    def register(
        self,
        name: str,
        strategy_cls: Callable[..., Strategy],
        description: str = "",
        override: bool = False,
        **init_kwargs: Any,
    ) -> None:
        """Register ``name`` to build ``strategy_cls(**init_kwargs)``.

        Raises:
            ConfigurationError: ``name`` is taken and ``override`` is False.
        """
        key = name.strip().lower()
        if key in self._entries and not override:
            raise ConfigurationError(
                f"A strategy named {name!r} is already registered "
                f"({self._entries[key].description or self._entries[key].strategy_cls}). "
                "Pick another name, or pass override=True to replace it."
            )
        self._entries[key] = StrategyEntry(key, strategy_cls, description, dict(init_kwargs))

    def remove(self, name: str) -> None:
        """Forget ``name`` (a no-op when it is not registered)."""
        self._entries.pop(name.strip().lower(), None)

    def get(self, name: str) -> StrategyEntry:
        """The entry for ``name``.

        Raises:
            ConfigurationError: no such name; the message suggests the closest one.
        """
        key = name.strip().lower()
        entry = self._entries.get(key)
        if entry is None:
            names = sorted(self._entries)
            raise ConfigurationError(
                f"Unknown strategy {name!r}.{did_you_mean(key, names)} Registered strategies: "
                f"{names}. Add your own with StrategyRegistry.register(name, cls, ...)."
            )
        return entry

    def available_strategies(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.strip().lower() in self._entries

    def __iter__(self) -> Iterator[StrategyEntry]:
        return iter(self._entries.values())


StrategyRegistry = _Registry()
"""The global registry ``Trainer(strategy=<name>)`` looks names up in."""


def _register_builtin() -> None:
    from accord.engines.deepspeed.strategy import DeepSpeedStrategy
    from accord.engines.horovod.strategy import HorovodStrategy
    from accord.engines.single.dp import DPStrategy
    from accord.engines.single.strategy import SingleDeviceStrategy
    from accord.engines.torch.ddp import DDPStrategy
    from accord.engines.torch.fsdp import FSDPStrategy
    from accord.engines.xla.strategy import SingleDeviceXLAStrategy, XLAStrategy

    reg = StrategyRegistry.register
    reg("single_device", SingleDeviceStrategy, "One device in this process.")
    reg("ddp", DDPStrategy, "DDP; re-runs the script for each extra local rank.")
    reg(
        "ddp_spawn",
        DDPStrategy,
        "DDP; ranks started with multiprocessing spawn.",
        start_method="spawn",
    )
    reg("ddp_fork", DDPStrategy, "DDP; ranks forked from this process.", start_method="fork")
    reg("ddp_notebook", DDPStrategy, "DDP from a notebook (fork).", start_method="fork")
    reg(
        "ddp_find_unused_parameters_true",
        DDPStrategy,
        "DDP that tolerates parameters without gradients.",
        find_unused_parameters=True,
    )
    reg(
        "ddp_spawn_find_unused_parameters_true",
        DDPStrategy,
        "ddp_spawn that tolerates parameters without gradients.",
        start_method="spawn",
        find_unused_parameters=True,
    )
    reg("dp", DPStrategy, "torch.nn.DataParallel over the local GPUs, in one process.")
    # DeepSpeedStrategy imports deepspeed only when a run starts; registering it is cheap.
    reg("deepspeed", DeepSpeedStrategy, "DeepSpeed engine, ZeRO stage 2.")
    reg("deepspeed_stage_1", DeepSpeedStrategy, "DeepSpeed ZeRO stage 1.", stage=1)
    reg("deepspeed_stage_2", DeepSpeedStrategy, "DeepSpeed ZeRO stage 2.", stage=2)
    reg(
        "deepspeed_stage_2_offload",
        DeepSpeedStrategy,
        "DeepSpeed ZeRO stage 2, optimizer states and step on the CPU.",
        stage=2,
        offload_optimizer=True,
    )
    reg("deepspeed_stage_3", DeepSpeedStrategy, "DeepSpeed ZeRO stage 3.", stage=3)
    reg(
        "deepspeed_stage_3_offload",
        DeepSpeedStrategy,
        "DeepSpeed ZeRO stage 3, optimizer states and parameters on the CPU.",
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
    )
    reg("fsdp", FSDPStrategy, "FSDP2 (fully_shard): parameters sharded across ranks.")
    reg(
        "fsdp_cpu_offload",
        FSDPStrategy,
        "FSDP2 with sharded parameters, gradients and optimizer step kept on the CPU.",
        cpu_offload=True,
    )
    # HorovodStrategy imports horovod only when a run starts; registering it is cheap.
    reg(
        "horovod",
        HorovodStrategy,
        "Horovod: its DistributedOptimizer averages gradients; start with horovodrun.",
    )
    # The XLA strategies import torch_xla only when a run starts; registering them is cheap.
    reg("xla", XLAStrategy, "XLA devices (TPU, XLA's CPU runtime); ranks from xmp.spawn.")
    reg("single_xla", SingleDeviceXLAStrategy, "One XLA device in this process.")


_register_builtin()
