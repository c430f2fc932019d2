"""Names a package face exports without importing their module until first use.

The faces (`accord.collectives`, `accord.strategies`, ...) re-export classes that live in
engine folders; an engine whose backend is optional (DeepSpeed, Horovod, XLA) is imported
only when one of its names is first read, so ``import accord`` never needs the backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first use."""

    def __getattr__(name: str) -> Any:  # noqa: N807  (module-level __getattr__, PEP 562)
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
