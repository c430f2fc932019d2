"""Strategies: how a model trains across devices, each built on one `Collective`."""

from accord.strategies.ddp import DDPStrategy
from accord.strategies.deepspeed import DeepSpeedStrategy, consolidate_deepspeed_checkpoint
from accord.strategies.dp import DPStrategy
from accord.strategies.fsdp import FSDPStrategy
from accord.strategies.parallel import ParallelStrategy
from accord.strategies.registry import StrategyEntry, StrategyRegistry
from accord.strategies.single_device import SingleDeviceStrategy
from accord.strategies.step_module import StepModule
from accord.strategies.strategy import RunSettings, Strategy
from accord.strategies.xla import SingleDeviceXLAStrategy, XLAStrategy

__all__ = [
    "DDPStrategy",
    "DPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ParallelStrategy",
    "RunSettings",
    "SingleDeviceStrategy",
    "SingleDeviceXLAStrategy",
    "StepModule",
    "Strategy",
    "StrategyEntry",
    "StrategyRegistry",
    "XLAStrategy",
    "consolidate_deepspeed_checkpoint",
]
