"""How a strategy starts its processes: none (torchrun, SLURM), subprocesses, spawn, fork, XLA."""

from accord.strategies.launchers.launcher import Launcher
from accord.strategies.launchers.multiprocessing import MultiprocessingLauncher
from accord.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from accord.strategies.launchers.xla import XLALauncher

__all__ = ["Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "XLALauncher"]
