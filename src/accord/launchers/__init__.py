"""How a strategy starts its processes: none (torchrun, SLURM), subprocesses, spawn, fork, XLA.

`XLALauncher` lives with its engine (`accord.engines.xla`) and is imported on first use.
"""

from accord.core.lazy import lazy_exports
from accord.core.parallel import START_METHOD_LAUNCHERS
from accord.environments.cluster_environment import ClusterEnvironment
from accord.launchers.launcher import Launcher
from accord.launchers.multiprocessing import MultiprocessingLauncher
from accord.launchers.subprocess_script import SubprocessScriptLauncher

__getattr__ = lazy_exports(__name__, {"XLALauncher": "accord.engines.xla.launcher"})


def _rerun_script(
    environment: ClusterEnvironment, processes: int, nodes: int, start_method: str
) -> Launcher:
    return SubprocessScriptLauncher(environment, processes, nodes)


def _multiprocessing(
    environment: ClusterEnvironment, processes: int, nodes: int, start_method: str
) -> Launcher:
    return MultiprocessingLauncher(environment, processes, start_method, nodes)


# What ParallelStrategy starts its ranks with, per start method.
START_METHOD_LAUNCHERS.update(
    popen=_rerun_script, spawn=_multiprocessing, fork=_multiprocessing, forkserver=_multiprocessing
)

__all__ = ["Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "XLALauncher"]
