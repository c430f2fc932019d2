"""Strategies: how a model trains across devices, each built on one `Collective`.

This is the public face; `Strategy` and `ParallelStrategy` live in `accord.core`, each
engine's strategies in `accord.engines`. `HorovodStrategy` is imported on first use.
"""

from accord.core.lazy import lazy_exports
from accord.core.parallel import ParallelStrategy
from accord.core.step_module import StepModule
from accord.core.strategy import RunSettings, Strategy
from accord.engines.deepspeed.strategy import DeepSpeedStrategy, consolidate_deepspeed_checkpoint
from accord.engines.single.dp import DPStrategy
from accord.engines.single.strategy import SingleDeviceStrategy
from accord.engines.torch.ddp import DDPStrategy
from accord.engines.torch.fsdp import FSDPStrategy
from accord.engines.xla.strategy import SingleDeviceXLAStrategy, XLAStrategy
from accord.strategies.registry import StrategyEntry, StrategyRegistry

__getattr__ = lazy_exports(__name__, {"HorovodStrategy": "accord.engines.horovod.strategy"})

__all__ = [
    "DDPStrategy",
    "DPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "HorovodStrategy",
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
