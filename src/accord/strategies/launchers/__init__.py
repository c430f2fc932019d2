"""How a strategy starts its processes: none (torchrun, SLURM), subprocesses, spawn or fork."""

from accord.strategies.launchers.launcher import Launcher
from accord.strategies.launchers.multiprocessing import MultiprocessingLauncher
from accord.strategies.launchers.subprocess_script import SubprocessScriptLauncher

__all__ = ["Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher"]
