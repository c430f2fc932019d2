"""Turns the Trainer's ``strategy``/``accelerator``/``devices``/``num_nodes``/``precision``
arguments into one configured `Strategy`, or an error that says what to pass instead."""

from __future__ import annotations

import torch

from accord.accelerators.accelerator import Accelerator, DevicesLike
from accord.accelerators.cpu import CPUAccelerator
from accord.accelerators.registry import accelerator_from_name
from accord.core.env_vars import env_number
from accord.core.strategy import Strategy
from accord.environments.cluster_environment import ClusterEnvironment
from accord.environments.local import LocalEnvironment
from accord.environments.slurm import SLURMEnvironment
from accord.environments.torchelastic import TorchElasticEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision, PrecisionMode
from accord.strategies.registry import StrategyRegistry

__all__ = ["connect", "detect_cluster_environment"]


def detect_cluster_environment() -> ClusterEnvironment:
    """torchrun first, then SLURM, else the local machine."""
    for cls in (TorchElasticEnvironment, SLURMEnvironment):
        if cls.detect():
            return cls()
    return LocalEnvironment()


def _distributed_requested(num_devices: int, num_nodes: int, env: ClusterEnvironment) -> bool:
    external = not isinstance(env, LocalEnvironment) and env_number("WORLD_SIZE", int, 1) > 1
    return num_devices > 1 or num_nodes > 1 or external


def connect(
    strategy: str | Strategy = "auto",
    accelerator: str | Accelerator = "auto",
    devices: DevicesLike = "auto",
    num_nodes: int = 1,
    precision: str | int | None = None,
) -> Strategy:
    """Build and configure the strategy the arguments describe.

    Raises:
        ConfigurationError: unknown names or impossible combinations, with what to do.
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigurationError(f"num_nodes={num_nodes!r} must be an int >= 1.")
    accel = _accelerator(strategy, accelerator)
    device_ids = accel.parse_devices(devices if devices != "auto" or accel.name != "cpu" else 1)
    env = detect_cluster_environment()

    if isinstance(strategy, str):
        key = strategy.strip().lower()
        if key == "auto":
            if _distributed_requested(len(device_ids), num_nodes, env):
                key = "ddp"
            else:
                key = "single_device"
        built = StrategyRegistry.get(key).build()
    elif isinstance(strategy, Strategy):
        built = strategy
    else:
        raise ConfigurationError(
            f"strategy={strategy!r} must be a registered name (e.g. 'ddp') or a Strategy instance."
        )
    if accelerator == "auto" and built.accelerator is not None and built.accelerator is not accel:
        # A named strategy that brings its own accelerator (the XLA ones) picks the devices.
        accel = built.accelerator
        device_ids = accel.parse_devices(devices)

    parallel_devices = accel.get_parallel_devices(device_ids)
    if built.accelerator is None:
        built.accelerator = accel
    elif not isinstance(built.accelerator, type(accel)) and accelerator != "auto":
        raise ConfigurationError(
            f"The strategy was built for accelerator {built.accelerator.name!r} but the Trainer "
            f"got accelerator={accel.name!r}. Pass one of them only."
        )
    mode = _precision_mode(built, precision)
    built.check_precision(mode, parallel_devices[0])
    own = built.precision
    if not built.precision_given or own.device_type != parallel_devices[0].type:
        built.precision = Precision(mode, parallel_devices[0])

    built.configure_devices(parallel_devices, num_nodes, env)
    _check_device_kind(built, accel)
    built.configure_launcher()
    return built


def _accelerator(strategy: str | Strategy, accelerator: str | Accelerator) -> Accelerator:
    """The Trainer's ``accelerator=``, or the one a strategy instance brings for ``"auto"``."""
    if (
        isinstance(strategy, Strategy)
        and strategy.accelerator is not None
        and accelerator == "auto"
    ):
        return strategy.accelerator
    if isinstance(accelerator, Accelerator):
        return accelerator
    if isinstance(accelerator, str):
        return accelerator_from_name(accelerator)
    raise ConfigurationError(
        f"accelerator={accelerator!r} must be a name ('cpu', 'cuda', 'mps', 'auto') or an "
        "Accelerator."
    )


def _precision_mode(strategy: Strategy, precision: str | int | None) -> PrecisionMode:
    """The Trainer's ``precision=``, or the strategy's own; both set and different: an error."""
    asked = PrecisionMode.parse(precision) if precision is not None else None
    if not strategy.precision_given:
        return asked or PrecisionMode.TRUE_32
    own = strategy.precision.mode
    if asked is not None and asked is not own:
        raise ConfigurationError(
            f"The strategy was built with precision {own.value!r} but the Trainer got "
            f"precision={asked.value!r}. Set it in one place: drop precision= from the "
            "Trainer, or build the strategy without a Precision."
        )
    return own


def _check_device_kind(strategy: Strategy, accel: Accelerator) -> None:
    device = strategy.root_device
    if isinstance(accel, CPUAccelerator) and device.type != "cpu":
        raise ConfigurationError(
            f"accelerator='cpu' but the strategy's device is {device}. Pass the matching "
            "accelerator, or build the strategy without a device."
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            f"The strategy targets {device}, but CUDA is not available. Use accelerator='cpu'."
        )
