"""How a strategy starts its processes: none (torchrun, SLURM), subprocesses, spawn, fork, XLA.

`XLALauncher` lives with its engine (`accord.engines.xla`) and is imported on first use.
"""

from accord.core.lazy import lazy_exports
from accord.launchers.launcher import Launcher
from accord.launchers.multiprocessing import MultiprocessingLauncher
from accord.launchers.subprocess_script import SubprocessScriptLauncher

__getattr__ = lazy_exports(__name__, {"XLALauncher": "accord.engines.xla.launcher"})

__all__ = ["Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "XLALauncher"]
