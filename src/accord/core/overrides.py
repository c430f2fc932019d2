"""How `Collective` takes a subclass's overrides of ``all_reduce`` and its primitives.

``all_reduce(..., async_op=True)`` came after some collectives were written, and users
compose collectives from mixins (``class Mine(Recording, TorchCollective)``). When a
subclass is created, `adapt_overrides` looks up through its MRO the methods it will really
run, wherever they are defined, and makes two repairs:

* an ``all_reduce`` that takes no ``async_op`` (by name or ``**kwargs``) is wrapped to take
  it: with ``async_op=True`` the override runs at the call and its result comes back as a
  completed `CollectiveHandle`, so DDP's gradient hook, which passes ``async_op=True``,
  still goes through the override;
* an `_all_reduce_` defined before (in the MRO) the `_all_reduce_async_` the class would
  run gets the synchronous fallback instead (`Collective._all_reduce_async_`, which calls
  `_all_reduce_`), so an inherited asynchronous primitive never bypasses the override.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from accord.core.handle import CollectiveHandle
from accord.core.reduce_op import ReduceOpLike

if TYPE_CHECKING:
    from accord.core.collective import Collective

__all__ = ["adapt_overrides"]


def adapt_overrides(cls: type[Collective], synchronous_fallback: Callable[..., Any]) -> None:
    """Adapt the overrides ``cls`` runs (see the module docs); ``Collective.__init_subclass__``
    calls it for every subclass, with its own `_all_reduce_async_` as the fallback."""
    if _order(cls, "_all_reduce_") < _order(cls, "_all_reduce_async_"):
        cls._all_reduce_async_ = synchronous_fallback  # type: ignore[method-assign]
    if not _takes_async_op(cls.all_reduce):
        cls.all_reduce = _adapt_sync_all_reduce(cls.all_reduce)  # type: ignore[method-assign]


def _order(cls: type, name: str) -> int:
    """The position in ``cls``'s MRO of the class whose own ``name`` it runs."""
    return next(i for i, owner in enumerate(cls.__mro__) if name in vars(owner))


def _takes_async_op(method: Callable[..., Any]) -> bool:
    """Whether an ``all_reduce`` override accepts ``async_op`` (by name or ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True  # nothing to adapt to: leave it as written
    return any(p.name == "async_op" or p.kind is p.VAR_KEYWORD for p in parameters)


def _adapt_sync_all_reduce(method: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``method``, an ``all_reduce`` without ``async_op``, taking it: a completed handle."""

    @functools.wraps(method)
    def all_reduce(
        self: Collective,
        tensor: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | CollectiveHandle:
        result = method(self, tensor, op) if out is None else method(self, tensor, op, out=out)
        return CollectiveHandle.completed(result) if async_op else result

    return all_reduce
