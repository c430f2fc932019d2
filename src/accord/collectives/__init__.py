"""Collectives: tensor and object communication primitives, one backend per class.

`DeepSpeedCollective`, `XLACollective` and `HorovodCollective` live in their own modules
and import their backend only when used.
"""

from accord.collectives.collective import Collective, ReduceOp, ReduceOpLike
from accord.collectives.single_device import SingleDeviceCollective
from accord.collectives.torch import TorchCollective

__all__ = ["Collective", "ReduceOp", "ReduceOpLike", "SingleDeviceCollective", "TorchCollective"]
