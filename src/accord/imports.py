"""Optional dependencies: the versions accord supports, and one way to ask for them.

Every package accord can run without is listed here once, as a lightning-utilities
`RequirementCache` holding the version range accord supports (the same as its extra in
``pyproject.toml``). A `RequirementCache` reads the installed distributions' metadata the
first time it is asked, and never imports the package, so ``import accord`` stays cheap.

Code that needs an optional package calls `require` where the feature is first asked for
(a constructor, a ``setup()``), and imports the package inside the function that uses it,
or through `import_optional`::

    from accord.imports import import_optional, require

    class DeepSpeedCollective(...):
        def __init__(self) -> None:
            require("deepspeed", "DeepSpeedCollective")  # checks, imports nothing

        def setup(self) -> None:
            comm = import_optional("deepspeed.comm", "DeepSpeedCollective")

Both raise `accord.errors.MissingDependencyError`, whose message names the feature, what is
wrong with the package and the ``pip install 'accord[<extra>]'`` that fixes it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

from accord.errors import MissingDependencyError

__all__ = [
    "DEEPSPEED_AVAILABLE",
    "HOROVOD_AVAILABLE",
    "NUMPY_AVAILABLE",
    "OPTIONAL_PACKAGES",
    "TENSORBOARD_AVAILABLE",
    "TORCH_XLA_AVAILABLE",
    "OptionalPackage",
    "import_optional",
    "import_problem",
    "require",
]

DEEPSPEED_AVAILABLE = RequirementCache("deepspeed==0.19.8")
"""Whether the supported DeepSpeed is installed (the version accord reads checkpoints of)."""

HOROVOD_AVAILABLE = RequirementCache("horovod>=0.28")
"""Whether a supported Horovod is installed."""

TORCH_XLA_AVAILABLE = RequirementCache("torch_xla>=2.4")
"""Whether a supported torch_xla is installed (it may still not import: `import_problem`)."""

TENSORBOARD_AVAILABLE = RequirementCache("tensorboard>=2.10")
"""Whether a supported TensorBoard is installed."""

NUMPY_AVAILABLE = RequirementCache("numpy")
"""Whether NumPy is installed (`accord.seed_everything` seeds it when it is)."""


@dataclass(frozen=True)
class OptionalPackage:
    """One optional package accord supports.

    Attributes:
        name: the name it is imported by (``torch_xla``).
        available: its requirement, with the supported versions; truthy when met.
        extra: accord's pip extra that installs it (``pip install 'accord[xla]'``).
    """

    name: str
    available: RequirementCache
    extra: str


OPTIONAL_PACKAGES: dict[str, OptionalPackage] = {
    package.name: package
    for package in (
        OptionalPackage("deepspeed", DEEPSPEED_AVAILABLE, "deepspeed"),
        OptionalPackage("horovod", HOROVOD_AVAILABLE, "horovod"),
        OptionalPackage("torch_xla", TORCH_XLA_AVAILABLE, "xla"),
        OptionalPackage("tensorboard", TENSORBOARD_AVAILABLE, "tensorboard"),
    )
}
"""The optional packages a feature can require, by the name they are imported by (NumPy is
only used when present, never required)."""


def _package(name: str) -> OptionalPackage:
    found = OPTIONAL_PACKAGES.get(name)
    if found is None:
        raise KeyError(
            f"{name!r} is not one of accord's optional packages: {sorted(OPTIONAL_PACKAGES)}."
        )
    return found


def require(package: str, feature: str) -> None:
    """Raise unless ``package`` is installed in a version accord supports and can be found;
    imports nothing.

    Args:
        package: an optional package's import name (a key of `OPTIONAL_PACKAGES`).
        feature: what needs it, for the message (``"DeepSpeedStrategy"``,
            ``"accelerator='xla'"``).

    Raises:
        MissingDependencyError: the package is missing, or installed in a version outside
            the supported range; the message names ``feature`` and the extra to install.
    """
    entry = _package(package)
    if entry.available and _findable(package):
        return
    requirement = entry.available.requirement or package
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = None
    if installed is None or not _findable(package):
        raise MissingDependencyError(feature, package, entry.extra)
    raise MissingDependencyError(
        feature,
        package,
        entry.extra,
        reason=f"is installed in version {installed}, but accord supports `{requirement}`",
    )


def _findable(package: str) -> bool:
    """Whether the import system finds ``package`` (without importing it): its files may be
    gone although its metadata is not, or ``sys.modules`` may hide it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def import_optional(module: str, feature: str) -> ModuleType:
    """`require` the package ``module`` belongs to, then import ``module`` and return it.

    Args:
        module: the package or one of its modules (``"deepspeed.comm"``).
        feature: what needs it, for the message.

    Raises:
        MissingDependencyError: as `require`, or the module does not import (a package
            built for another torch, for example); the message says why.
    """
    package = module.partition(".")[0]
    require(package, feature)
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            feature, package, _package(package).extra, reason=f"does not import ({err})"
        ) from err


@functools.cache
def import_problem(package: str) -> str | None:
    """Why ``package`` cannot be used in this process, or None when it can.

    Imports the package (once per process; the answer is kept): for a probe such as an
    accelerator's ``is_available()``, where an installed package may still fail to import.
    Returns ``""`` when the package is not installed in a supported version.
    """
    if not _package(package).available:
        return ""
    try:
        importlib.import_module(package)
    except ImportError as err:  # built for another torch release, typically
        return str(err)
    return None
