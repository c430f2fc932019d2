"""What a rank started with ``spawn`` or ``forkserver`` could not be handed: the first part
of its work that does not pickle, named by its path (``trainer.datamodule.lock``), and the
error `MultiprocessingLauncher` raises for it."""

from __future__ import annotations

import inspect
import multiprocessing
import pickle
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["find_unpicklable", "unpicklable_message"]


def unpicklable_message(
    start_method: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    err: Exception,
) -> str:
    """What to say when ``fn(*args, **kwargs)`` does not pickle (``err``) for ranks started
    with ``start_method``: which part, and the ways out."""
    where = find_unpicklable(fn, args, kwargs)
    what = f"`{where}`" if where else "something"
    fork = (
        ", or strategy='ddp_fork' / 'ddp_notebook' (fork: nothing is pickled)"
        if "fork" in multiprocessing.get_all_start_methods()
        else ""
    )
    return (
        f"Starting ranks with start_method={start_method!r} pickles what they run "
        f"(the Trainer, the model, the data loaders), and {what} could not be pickled: "
        f"{type(err).__name__}: {err}. Make it picklable (a function or class defined at "
        "module level, not a lambda or a local one; no open locks, files or sockets), or "
        f"use strategy='ddp' (it re-runs your script, so nothing is pickled){fork}."
    )


def find_unpicklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The path of the first part of ``fn(*args, **kwargs)`` that does not pickle, if found."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"argument {i}": arg for i, arg in enumerate(args)} | kwargs
    roots = list(bound.items())
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        roots.append((type(owner).__name__, owner))
    for name, value in roots:
        found = _unpicklable_path(value, name, depth=4)
        if found is not None:
            return found
    return None


def _unpicklable_path(obj: Any, path: str, depth: int) -> str | None:
    if _pickles(obj):
        return None
    if depth > 0:
        for suffix, child in _parts(obj):
            found = _unpicklable_path(child, path + suffix, depth - 1)
            if found is not None:
                return found
    return path


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        yield from ((f"[{key!r}]", value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple)):
        yield from ((f"[{i}]", value) for i, value in enumerate(obj))
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if name == "_modules" and isinstance(value, dict):
                # An nn.Module keeps its submodules here; users know them as attributes.
                yield from ((f".{key}", module) for key, module in value.items())
            else:
                yield f".{name}", value


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickles(obj: Any) -> bool:
    # Pickled into nothing: a large dataset is walked, never held twice in memory.
    try:
        pickle.Pickler(_Discard()).dump(obj)
    except Exception:
        return False
    return True
