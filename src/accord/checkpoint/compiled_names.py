"""Parameter names of models that ``torch.compile`` compiled, wholly or in part.

``torch.compile(module)`` returns a wrapper that holds the module as its child
``_orig_mod``, so a model whose network was compiled in ``__init__``
(``self.net = torch.compile(self.net)``) names its weights ``net._orig_mod.0.weight`` where
the uncompiled model says ``net.0.weight``. accord's checkpoints hold the plain names
(`plain_names`), whatever was compiled, and a state dict loads into the compiled and the
uncompiled model alike (`module_names` renames it to the module's own names). One
consequence: a submodule of the user's that is itself called ``_orig_mod`` loses that part of
its names in checkpoints, as it does in ``torch.distributed.checkpoint``'s state dicts.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

from torch import nn

__all__ = ["compiled_modules", "is_compiled", "module_names", "plain_name", "plain_names"]

_WRAPPED = "_orig_mod"
"""The attribute under which ``torch.compile``'s wrapper holds the compiled module."""

V = TypeVar("V")


def is_compiled(obj: object) -> bool:
    """Whether ``obj`` is what ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    # torch.compile imports torch._dynamo; where it was never imported, nothing is compiled,
    # and `import accord` stays free of dynamo's import time.
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(obj, OptimizedModule)


def compiled_modules(module: nn.Module) -> Iterator[str]:
    """The names of the compiled modules inside ``module`` (``""`` for ``module`` itself)."""
    if "torch._dynamo" not in sys.modules:
        return
    for name, child in module.named_modules():
        if is_compiled(child):
            yield name


def plain_name(key: str) -> str:
    """``key`` without the ``_orig_mod`` parts compiled modules add to it."""
    if _WRAPPED not in key:
        return key
    return ".".join(part for part in key.split(".") if part != _WRAPPED)


def plain_names(state: dict[str, V]) -> dict[str, V]:
    """``state`` with every key a `plain_name` (``state`` itself when all already are).

    The version record a module's ``state_dict()`` carries (``_metadata``, keyed by module
    name) is renamed with it.
    """
    if not any(_WRAPPED in key for key in state):
        return state
    return _renamed(state, plain_name)


def module_names(module: nn.Module, state: dict[str, V]) -> dict[str, V]:
    """``state`` renamed to ``module``'s own names: an entry whose `plain_name` is that of one
    of ``module``'s entries takes that entry's name, compiled or not; others keep theirs, so
    a strict load still reports them. ``state`` itself when neither ``module`` nor
    ``state`` has compiled parts."""
    compiled = any(True for _ in compiled_modules(module))
    if not compiled and not any(_WRAPPED in key for key in state):
        return state
    own = {plain_name(key): key for key in module.state_dict(keep_vars=True)}
    owners = {plain_name(name): name for name, _ in module.named_modules()}
    renamed = _renamed(state, lambda key: own.get(plain_name(key), key))
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, dict):
        renamed._metadata = {  # type: ignore[attr-defined]
            owners.get(plain_name(name), name): value for name, value in metadata.items()
        }
    return renamed


def _renamed(state: dict[str, V], rename: Callable[[str], str]) -> OrderedDict[str, V]:
    result: OrderedDict[str, V] = OrderedDict((rename(key), value) for key, value in state.items())
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, dict):
        result._metadata = {plain_name(name): value for name, value in metadata.items()}  # type: ignore[attr-defined]
    return result
