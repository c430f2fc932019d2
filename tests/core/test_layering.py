"""The core imports no concrete launcher, accelerator or engine; strategies and collectives
are asked what they need instead of being tested for their class; the checkpoint package
imports no layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from accord.collectives import (
    DebugCollective,
    InstrumentedCollective,
    SingleDeviceCollective,
    TorchCollective,
    WatchdogCollective,
)

CORE = Path(__file__).resolve().parents[2] / "src" / "accord" / "core"
CHECKPOINT = CORE.parent / "checkpoint"

# What the core must not import at run time (type-only imports may name them).
FORBIDDEN = (
    "accord.engines",
    "accord.launchers.multiprocessing",
    "accord.launchers.subprocess_script",
    "accord.accelerators.cpu",
    "accord.accelerators.cuda",
    "accord.accelerators.mps",
    "accord.accelerators.registry",
    "accord.trainer",
)


def _runtime_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(child) for child in ast.walk(node))
    names = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: p.name)
def test_the_core_imports_no_concrete_part(path: Path) -> None:
    found = [name for name in _runtime_imports(path) if name.startswith(FORBIDDEN)]
    assert not found, f"{path.relative_to(CORE.parent)} imports {found}"


# What accord.checkpoint must not import: the layers that use it. Its command line alone
# imports the engines' checkpoint readers, by name, as a package face does.
CHECKPOINT_FORBIDDEN = (
    "accord.core",
    "accord.strategies",
    "accord.trainer",
    "accord.callbacks",
    "accord.module",
    "accord.engines",
)


@pytest.mark.parametrize("path", sorted(CHECKPOINT.rglob("*.py")), ids=lambda p: p.name)
def test_the_checkpoint_package_imports_no_layer_above_it(path: Path) -> None:
    allowed = ("accord.engines",) if path.name == "cli.py" else ()
    found = [
        name
        for name in _runtime_imports(path)
        if name.startswith(CHECKPOINT_FORBIDDEN)
        and not any(name.startswith(part) for part in allowed)
    ]
    assert not found, f"{path.relative_to(CORE.parent)} imports {found}"


def test_a_debug_check_anywhere_in_the_wrappers_asks_for_engine_traffic() -> None:
    inner = SingleDeviceCollective()
    assert not inner.wants_engine_traffic
    assert not InstrumentedCollective(TorchCollective("gloo")).wants_engine_traffic
    assert DebugCollective(inner).wants_engine_traffic
    checked = WatchdogCollective(InstrumentedCollective(DebugCollective(inner)), 30.0)
    assert checked.wants_engine_traffic
