"""Collectives: tensor and object communication primitives, one backend per class.

This is the public face; the classes live in `accord.core` (the contract and the wrappers)
and in `accord.engines` (one collective per engine). `DeepSpeedCollective`, `XLACollective`
and `HorovodCollective` are imported on first use, so their backends stay optional. The
wrappers (`DebugCollective`, `InstrumentedCollective`, `WatchdogCollective`) work around any
collective.
"""

from accord.core.collective import Collective, CollectiveHandle, ReduceOp, ReduceOpLike
from accord.core.lazy import lazy_exports
from accord.core.process_group import ProcessGroupCollective
from accord.core.wrappers.debug import DebugCollective
from accord.core.wrappers.policy import maybe_debug, maybe_watchdog
from accord.core.wrappers.stats import CollectiveStats, InstrumentedCollective, OpStats
from accord.core.wrappers.watchdog import WatchdogCollective
from accord.core.wrappers.wrapper import CollectiveWrapper, unwrap
from accord.engines.single.collective import SingleDeviceCollective
from accord.engines.torch.collective import TorchCollective

__getattr__ = lazy_exports(
    __name__,
    {
        "DeepSpeedCollective": "accord.engines.deepspeed.collective",
        "HorovodCollective": "accord.engines.horovod.collective",
        "XLACollective": "accord.engines.xla.collective",
    },
)

__all__ = [
    "Collective",
    "CollectiveHandle",
    "CollectiveStats",
    "CollectiveWrapper",
    "DebugCollective",
    "DeepSpeedCollective",
    "HorovodCollective",
    "InstrumentedCollective",
    "OpStats",
    "ProcessGroupCollective",
    "ReduceOp",
    "ReduceOpLike",
    "SingleDeviceCollective",
    "TorchCollective",
    "WatchdogCollective",
    "XLACollective",
    "maybe_debug",
    "maybe_watchdog",
    "unwrap",
]
