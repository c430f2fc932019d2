"""DeepSpeed's CPU shared-memory extension: where it is built, and the checks before a build.

On a CPU machine the first ``deepspeed.init_distributed`` compiles the C++ extension
``deepspeed_shm_comm`` with ``torch.utils.cpp_extension`` (about 45-95 s on two cores,
printing nothing), and later runs load the cached library. torch puts it in
``$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm`` when that variable is set, else in
``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>/deepspeed_shm_comm``.

`prepare_extension_build` runs before DeepSpeed does and handles the two ways that first
use goes wrong. The silence: a one-line notice says what is compiled, where, and for how
long. A build that was killed leaves its ``lock`` file behind, and torch then waits for it
forever: a lock older than any build takes (`lock_timeout`) is refused with an error that
names it, and a younger one (a build in progress elsewhere) is waited for, with a notice.

``python -m accord.engines.deepspeed.extension`` builds the extension ahead of time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accord.core.env_vars import env_number
from accord.errors import CollectiveError, MissingDependencyError
from accord.imports import import_optional

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "LOCK_TIMEOUT_ENV_VAR",
    "ExtensionBuild",
    "build_shm_extension",
    "lock_timeout",
    "main",
    "prepare_extension_build",
    "prepare_shm_extension",
    "shm_extension_build",
]

_log = logging.getLogger(__name__)

LOCK_TIMEOUT_ENV_VAR = "ACCORD_EXTENSION_LOCK_TIMEOUT"
"""Seconds after which an extension's build lock counts as left behind by a killed build."""

DEFAULT_LOCK_TIMEOUT = 600.0
"""Ten minutes: several times the longest build seen on two cores."""

_POLL_SECONDS = 0.5
_BUILDER = "ShareMemCommBuilder"
_FEATURE = "DeepSpeedCollective"
"""What a missing-deepspeed error names: the collective's setup builds the extension."""


@dataclass(frozen=True)
class ExtensionBuild:
    """Where torch builds one C++ extension, and what it builds from.

    Attributes:
        name: the extension's name; its library is ``<name>.so`` in ``directory``.
        directory: torch's build directory for it (``TORCH_EXTENSIONS_DIR/<name>`` or
            torch's default).
        sources: the absolute paths of the files it is compiled from.
    """

    name: str
    directory: Path
    sources: tuple[Path, ...] = ()

    @property
    def library(self) -> Path:
        """The compiled library torch loads (the extension only builds on Linux)."""
        return self.directory / f"{self.name}.so"

    @property
    def lock(self) -> Path:
        """The file torch creates while a process builds or checks the extension."""
        return self.directory / "lock"

    @property
    def is_built(self) -> bool:
        """Whether torch will load the library as it is, without compiling.

        The library must exist, be newer than every source, and have been built from these
        very sources: ``build.ninja`` records their absolute paths, so a directory last
        built by another environment is rebuilt.
        """
        try:
            built = self.library.stat().st_mtime
            recipe = (self.directory / "build.ninja").read_text()
        except FileNotFoundError:
            return False
        return all(
            str(source) in recipe and (not source.exists() or source.stat().st_mtime <= built)
            for source in self.sources
        )


def lock_timeout() -> float:
    """Seconds from `LOCK_TIMEOUT_ENV_VAR`, else `DEFAULT_LOCK_TIMEOUT` (``inf``: never stale).

    Raises:
        ConfigurationError: the variable is not a positive number of seconds.
    """
    return env_number(
        LOCK_TIMEOUT_ENV_VAR,
        float,
        DEFAULT_LOCK_TIMEOUT,
        positive=True,
        unit="seconds",
        hint=f"unset it for the default ({DEFAULT_LOCK_TIMEOUT:.0f} s)",
    )


def shm_extension_build() -> ExtensionBuild | None:
    """The build of DeepSpeed's shared-memory extension, as DeepSpeed would run it here.

    None when DeepSpeed will not compile it: another accelerator than the CPU, an
    incompatible machine, or an extension that was built into the DeepSpeed install.

    Raises:
        MissingDependencyError: deepspeed is not installed.
    """
    accelerator = import_optional("deepspeed.accelerator", _FEATURE).get_accelerator()
    builder: Any = accelerator.create_op_builder(_BUILDER)
    if builder is None:
        return None
    # The same tests as DeepSpeed's build_shm_op (in its torch communication backend) and
    # OpBuilder.load.
    ops = import_optional("deepspeed.ops", _FEATURE)
    compatible: dict[str, bool] = ops.__compatible_ops__
    if not compatible.get(builder.NAME, False):
        return None
    installed = import_optional("deepspeed.git_version_info", _FEATURE)
    if installed.installed_ops.get(builder.name, False) and (
        installed.accelerator_name == accelerator._name
    ):
        return None
    # torch's own function, so the directory is exactly the one its build will use.
    from torch.utils.cpp_extension import _get_build_directory

    # Absolute, as DeepSpeed hands them to torch (and torch writes them into build.ninja).
    sources = tuple(Path(builder.deepspeed_src_path(path)).absolute() for path in builder.sources())
    return ExtensionBuild(builder.name, Path(_get_build_directory(builder.name, False)), sources)


def prepare_extension_build(
    build: ExtensionBuild, *, announce: bool, stale_after: float | None = None
) -> None:
    """Make sure ``build`` will not hang on a dead lock, and say when a build is coming.

    A lock younger than ``stale_after`` belongs to a build in progress: wait until it is
    released. An older one was left by a build that was killed: refuse it. Then, when the
    library is missing or out of date, print a notice that it is being compiled.

    Args:
        build: the extension's build.
        announce: log the notices (at INFO, `accord.log`): true on rank zero only.
        stale_after: seconds after which a lock counts as left behind; default:
            `lock_timeout()`.

    Raises:
        CollectiveError: the lock is older than ``stale_after``; the message names it.
        ConfigurationError: `LOCK_TIMEOUT_ENV_VAR` is not a positive number.
    """
    timeout = lock_timeout() if stale_after is None else stale_after
    waiting = False
    while (age := _age(build.lock)) is not None:
        if age > timeout:
            raise CollectiveError(_stale_message(build, age, timeout))
        if announce and not waiting:
            _log.info(
                f"waiting for another process to finish building DeepSpeed's "
                f"{build.name} extension in {build.directory} (it holds {build.lock}, "
                f"{age:.0f} s old, refused at {timeout:g} s; if no build is running, delete it)"
            )
        waiting = True
        time.sleep(_POLL_SECONDS)
    if announce and not build.is_built:
        _log.info(
            f"compiling DeepSpeed's {build.name} extension into {build.directory}; "
            "this takes 1-2 minutes (more on a busy machine), once for this directory "
            "(TORCH_EXTENSIONS_DIR)"
        )


def prepare_shm_extension(*, announce: bool) -> ExtensionBuild | None:
    """`prepare_extension_build` for DeepSpeed's shared-memory extension, if it is built here.

    Args:
        announce: log the notices: true on rank zero only.

    Returns:
        The build, or None when DeepSpeed will not compile the extension here.
    """
    build = shm_extension_build()
    if build is not None:
        prepare_extension_build(build, announce=announce)
    return build


def build_shm_extension() -> ExtensionBuild | None:
    """Build DeepSpeed's shared-memory extension now, as its first use would.

    Returns:
        The build, or None when DeepSpeed does not compile the extension here.

    Raises:
        MissingDependencyError: deepspeed is not installed.
        CollectiveError: a stale build lock (see `prepare_extension_build`).
    """
    build = prepare_shm_extension(announce=True)
    if build is not None:
        accelerator = import_optional("deepspeed.accelerator", _FEATURE).get_accelerator()
        accelerator.create_op_builder(_BUILDER).load()
    return build


def _age(path: Path) -> float | None:
    """Seconds since ``path`` was last modified, or None if it does not exist."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return None


def _stale_message(build: ExtensionBuild, age: float, timeout: float) -> str:
    return (
        f"DeepSpeed's {build.name} extension cannot be built or loaded: the lock file "
        f"{build.lock} is {age:.0f} s old, older than a build may take "
        f"({LOCK_TIMEOUT_ENV_VAR}={timeout:g} seconds), so a build was killed before it finished "
        f"and torch would wait for it forever. Once no other DeepSpeed run is building it, delete "
        f"it (rm '{build.lock}') and run again."
    )


def main() -> None:
    """Build the extension now and say where it is; ``python -m`` runs this module."""
    try:
        build = build_shm_extension()
    except MissingDependencyError:
        print("deepspeed is not installed; nothing to build")
        return
    if build is None:
        print("DeepSpeed does not compile its shared-memory extension on this machine")
    else:
        print(f"DeepSpeed's {build.name} extension is built in {build.directory}")


if __name__ == "__main__":
    main()
