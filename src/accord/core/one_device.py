"""`OneDeviceStrategy`: the base of strategies that train on one device in one process.

Whatever the engine (a CPU or CUDA device, one XLA device), such a strategy has a world of
one, a device the Trainer picks from ``devices=``, and no rendezvous; the Trainer treats
every subclass the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from accord.core.strategy import Strategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """A strategy on one device, in this process only.

    Attributes:
        device: the device to train on; the Trainer sets it from ``devices=``.
    """

    device: torch.device

    @property
    @override
    def root_device(self) -> torch.device:
        return self.device

    @override
    def collective_setup_kwargs(self) -> dict[str, Any]:
        return {}
