"""`CollectiveWrapper`: a collective that forwards to another one, with a hook around each op.

The debugging, statistics and watchdog collectives are wrappers: they add work before or
around every public operation and otherwise behave exactly like the collective they wrap,
so they work on every backend and can be stacked::

    WatchdogCollective(DebugCollective(InstrumentedCollective(TorchCollective("gloo"))), 60)

A wrapper's primitives forward to the wrapped collective's primitives, so private traffic a
wrapper sends itself (a fingerprint, an arrival check) is not seen by the wrappers inside it.

An ``all_reduce(..., async_op=True)`` goes through `CollectiveWrapper._run` like any call:
``perform()`` starts it and returns the inner collective's `CollectiveHandle`, which a
wrapper passes on (a wrapper that measures the call waits for its completion with
`CollectiveHandle.add_done_callback`, never with ``wait()``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any, Literal, NamedTuple, TypeVar, overload

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, CollectiveHandle, ReduceOp, ReduceOpLike

__all__ = ["CallSite", "CollectiveWrapper", "OpCall", "call_site", "unwrap"]

_T = TypeVar("_T")


class _InnerBackendName:
    """``backend_name`` of a wrapper: the wrapped collective's, so messages name the backend."""

    def __get__(self, obj: CollectiveWrapper | None, objtype: type[Any] | None = None) -> str:
        if obj is None:
            return "wrapped collective"
        return obj.inner.backend_name


class OpCall:
    """What one public operation was called with, as a wrapper's hook sees it.

    Attributes:
        op: the public method's name (``"all_reduce"``, ``"barrier"``, ``"send"``, ...).
        tensor: the tensor argument (None for barrier and object ops).
        reduce_op: the reduction as passed (all_reduce and reduce_scatter), else None.
        root: ``src`` or ``dst`` where the op has one, else None.
        label: the barrier's name, else None.
    """

    __slots__ = ("label", "op", "reduce_op", "root", "tensor")

    def __init__(
        self,
        op: str,
        tensor: Any = None,
        *,
        reduce_op: ReduceOpLike | None = None,
        root: Any = None,
        label: str | None = None,
    ) -> None:
        self.op = op
        self.tensor = tensor
        self.reduce_op = reduce_op
        self.root = root
        self.label = label

    @property
    def is_point_to_point(self) -> bool:
        """True for send and recv, which only two ranks take part in."""
        return self.op in ("send", "recv")

    def __repr__(self) -> str:
        return f"OpCall({self.op!r})"


class CollectiveWrapper(Collective):
    """A `Collective` that forwards everything to ``inner``.

    Subclasses override `_run`, which every public operation goes through with a
    description of the call (`OpCall`) and a function that performs it on ``inner``.
    Lifecycle and identity (`setup`, `teardown`, `rank`, `world_size`, `is_setup`,
    `created_group`, `object_device`) are ``inner``'s.

    Args:
        inner: the collective to wrap (set up or not).
    """

    backend_name = _InnerBackendName()

    def __init__(self, inner: Collective) -> None:
        if not isinstance(inner, Collective):
            raise TypeError(
                f"{type(self).__name__} wraps a Collective, got {type(inner).__name__}."
            )
        self._inner = inner

    @property
    def inner(self) -> Collective:
        """The wrapped collective."""
        return self._inner

    # ------------------------------------------------------------------ the hook
    def _run(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        """Run one public operation: ``perform()`` does it on ``inner``. Override to add work."""
        return perform()

    # ----------------------------------------------------------------- lifecycle
    @property
    @override
    def rank(self) -> int:
        return self._inner.rank

    @property
    @override
    def world_size(self) -> int:
        return self._inner.world_size

    @property
    @override
    def is_setup(self) -> bool:
        return self._inner.is_setup

    @property
    @override
    def created_group(self) -> bool:
        return self._inner.created_group

    @property
    @override
    def object_device(self) -> torch.device:
        return self._inner.object_device

    @property
    @override
    def wants_engine_traffic(self) -> bool:
        return self._inner.wants_engine_traffic

    @override
    def setup(self, **kwargs: Any) -> Self:
        self._inner.setup(**kwargs)
        return self

    @override
    def teardown(self) -> Self:
        self._inner.teardown()
        return self

    @override
    def abandon(self) -> None:
        self._inner.abandon()

    # ---------------------------------------------------------------- primitives
    # Forwarded as is: a wrapper's own traffic goes straight to the innermost backend.
    @override
    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self._inner._all_reduce_(buffer, op)

    @override
    def _all_reduce_async_(
        self, buffer: torch.Tensor, op: ReduceOp
    ) -> torch.futures.Future[Any] | None:
        return self._inner._all_reduce_async_(buffer, op)

    @override
    def _op(self, name: str) -> AbstractContextManager[None]:
        return self._inner._op(name)

    @override
    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        self._inner._broadcast_(buffer, src)

    @override
    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._inner._all_gather_into(output, tensor)

    @override
    def _reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
    ) -> None:
        self._inner._reduce_scatter_into(output, tensor, op)

    @override
    def _barrier(self) -> None:
        self._inner._barrier()

    @override
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._inner._send(tensor, dst)

    @override
    def _recv_(self, buffer: torch.Tensor, src: int) -> None:
        self._inner._recv_(buffer, src)

    @override
    def _gather_into(self, output: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        self._inner._gather_into(output, tensor, dst)

    @override
    def _scatter_into(self, output: torch.Tensor, tensor: torch.Tensor | None, src: int) -> None:
        self._inner._scatter_into(output, tensor, src)

    @override
    def _all_to_all_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._inner._all_to_all_into(output, tensor)

    # ------------------------------------------------------------ public ops
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: Literal[True],
    ) -> CollectiveHandle: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = ...,
        *,
        out: torch.Tensor | None = ...,
        async_op: bool,
    ) -> torch.Tensor | CollectiveHandle: ...

    @override
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | CollectiveHandle:
        if async_op:
            return self._run(
                OpCall("all_reduce", tensor, reduce_op=op),
                lambda: self._inner.all_reduce(tensor, op, out=out, async_op=True),
            )
        return self._run(
            OpCall("all_reduce", tensor, reduce_op=op),
            lambda: self._inner.all_reduce(tensor, op, out=out),
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._run(
            OpCall("broadcast", tensor, root=src),
            lambda: self._inner.broadcast(tensor, src, out=out),
        )

    @override
    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(
            OpCall("all_gather", tensor), lambda: self._inner.all_gather(tensor, out=out)
        )

    @override
    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._run(
            OpCall("reduce_scatter", tensor, reduce_op=op),
            lambda: self._inner.reduce_scatter(tensor, op, out=out),
        )

    @override
    def barrier(self, name: str | None = None) -> None:
        self._run(OpCall("barrier", label=name), lambda: self._inner.barrier(name))

    @override
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._run(OpCall("send", tensor, root=dst), lambda: self._inner.send(tensor, dst))

    @override
    def recv(
        self, tensor: torch.Tensor, src: int, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._run(
            OpCall("recv", tensor, root=src), lambda: self._inner.recv(tensor, src, out=out)
        )

    @override
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return self._run(
            OpCall("gather", tensor, root=dst), lambda: self._inner.gather(tensor, dst, out=out)
        )

    @override
    def scatter(
        self, tensor: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._run(
            OpCall("scatter", tensor, root=src), lambda: self._inner.scatter(tensor, src, out=out)
        )

    @override
    def all_to_all(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(
            OpCall("all_to_all", tensor), lambda: self._inner.all_to_all(tensor, out=out)
        )

    @override
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self._run(
            OpCall("broadcast_object", root=src), lambda: self._inner.broadcast_object(obj, src)
        )

    @override
    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._run(OpCall("all_gather_object"), lambda: self._inner.all_gather_object(obj))

    # --------------------------------------------------------------- helpers
    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


def unwrap(collective: Collective) -> Collective:
    """The innermost collective under any number of `CollectiveWrapper` layers.

    Use it where code needs the backend's own object (e.g. a `TorchCollective`'s process
    group for DDP) and may have been handed a wrapped collective.
    """
    while isinstance(collective, CollectiveWrapper):
        collective = collective.inner
    return collective


class CallSite(NamedTuple):
    """A place in the source: ``file:line in function``."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


_UNKNOWN_SITE = CallSite("<unknown>", 0, "<unknown>")


def _is_own(module: str) -> bool:
    # accord.testing drives collectives on a test's behalf, so it counts as a caller.
    return (module == "accord" or module.startswith("accord.")) and not module.startswith(
        "accord.testing"
    )


def call_site() -> tuple[CallSite, CallSite | None]:
    """Where the current collective call came from, as ``(site, via)``.

    ``site`` is the innermost frame outside accord's own modules (the user's line, or the
    test kit's); ``via`` is the innermost accord frame outside ``accord.collectives`` on the
    way there (e.g. the strategy helper that made the call), or None.
    """
    frame: FrameType | None = sys._getframe(1)
    via: CallSite | None = None
    last: CallSite | None = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        code = frame.f_code
        here = CallSite(code.co_filename, frame.f_lineno, code.co_name)
        if not isinstance(module, str) or not _is_own(module):
            return here, via
        if via is None and not module.startswith("accord.collectives"):
            via = here
        last = here
        frame = frame.f_back
    return last or _UNKNOWN_SITE, None
