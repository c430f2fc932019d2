"""Strategy names → factories, so ``Trainer(strategy="ddp")`` works and users can add names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from accord.errors import ConfigurationError, did_you_mean
from accord.strategies.strategy import Strategy

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
    from accord.strategies.ddp import DDPStrategy
    from accord.strategies.dp import DPStrategy
    from accord.strategies.single_device import SingleDeviceStrategy

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


_register_builtin()
