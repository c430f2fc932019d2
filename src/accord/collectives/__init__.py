"""Collectives: tensor and object communication primitives, one backend per class.

`DeepSpeedCollective`, `XLACollective` and `HorovodCollective` live in their own modules
and import their backend only when used. The wrappers (`DebugCollective`,
`InstrumentedCollective`, `WatchdogCollective`) work around any collective.
"""

from accord.collectives.collective import Collective, ReduceOp, ReduceOpLike
from accord.collectives.debug import DebugCollective, maybe_debug
from accord.collectives.single_device import SingleDeviceCollective
from accord.collectives.stats import CollectiveStats, InstrumentedCollective, OpStats
from accord.collectives.torch import TorchCollective
from accord.collectives.watchdog import WatchdogCollective, maybe_watchdog
from accord.collectives.wrapper import CollectiveWrapper, unwrap

__all__ = [
    "Collective",
    "CollectiveStats",
    "CollectiveWrapper",
    "DebugCollective",
    "InstrumentedCollective",
    "OpStats",
    "ReduceOp",
    "ReduceOpLike",
    "SingleDeviceCollective",
    "TorchCollective",
    "WatchdogCollective",
    "maybe_debug",
    "maybe_watchdog",
    "unwrap",
]
