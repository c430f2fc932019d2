"""The launchers' earlier import path; they live in `accord.launchers`."""

from accord.launchers import (
    Launcher,
    MultiprocessingLauncher,
    SubprocessScriptLauncher,
)
from accord.launchers import __getattr__ as __getattr__

__all__ = ["Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "XLALauncher"]
