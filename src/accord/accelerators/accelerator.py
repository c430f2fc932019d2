"""`Accelerator`: facts about one kind of device (how many, which, how to prepare one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from accord.errors import ConfigurationError

__all__ = ["Accelerator", "DevicesLike"]

DevicesLike = int | str | list[int] | tuple[int, ...]
"""``devices=`` as users pass it: a count, ``"auto"``, ``"-1"`` (all), or device indices."""


class Accelerator(ABC):
    """One kind of device. Strategies ask it for devices; they never probe hardware."""

    name: ClassVar[str]
    """Registered name (``"cpu"``, ``"cuda"``, ...)."""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this kind of device can be used in this process."""

    @staticmethod
    @abstractmethod
    def auto_device_count() -> int:
        """How many devices ``devices="auto"`` means."""

    @abstractmethod
    def get_parallel_devices(self, devices: list[int]) -> list[torch.device]:
        """The `torch.device` of each index (one per local process)."""

    def setup_device(self, device: torch.device) -> None:
        """Prepare ``device`` for use by this process (select it, for instance)."""

    def teardown(self) -> None:
        """Release what `setup_device` took."""

    def parse_devices(self, devices: DevicesLike) -> list[int]:
        """Turn ``devices=`` into device indices, or raise with what to pass instead."""
        if isinstance(devices, str):
            text = devices.strip().lower()
            if text == "auto" or text == "-1":
                return list(range(self.auto_device_count()))
            if text.isdigit():
                devices = int(text)
            else:
                try:
                    devices = [int(part) for part in text.split(",") if part.strip()]
                except ValueError:
                    raise ConfigurationError(
                        f"devices={devices!r} is not understood. Pass a count (2), 'auto', "
                        "-1 for all, or a list of indices ([0, 1])."
                    ) from None
        if isinstance(devices, bool):
            raise ConfigurationError(f"devices={devices!r} is not a count; pass an int >= 1.")
        if isinstance(devices, int):
            if devices == -1:
                return list(range(self.auto_device_count()))
            if devices < 1:
                raise ConfigurationError(
                    f"devices={devices} asks for no devices. Pass devices >= 1, 'auto' or -1."
                )
            return self._check_count(devices)
        indices = list(devices)
        if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
            raise ConfigurationError(
                f"devices={devices!r} must be distinct, non-negative indices, e.g. [0, 1]."
            )
        self._check_count(max(indices) + 1)
        return indices

    def _check_count(self, count: int) -> list[int]:
        return list(range(count))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
