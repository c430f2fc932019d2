"""`CollectiveHandle`: the pending result of an asynchronous collective operation.

``collective.all_reduce(t, op, async_op=True)`` starts the reduction and returns a handle at
once; the caller overlaps other work with the transfer and collects the result with
`CollectiveHandle.wait`, or hands `CollectiveHandle.get_future` to code that takes a
`torch.futures.Future` (a DDP communication hook). The result keeps every promise of the
synchronous form: the input is left unchanged unless it is ``out=``, the result lies on the
input's device, the mean of an integer tensor is floating point. The work that makes it so
(dividing for a mean, casting, copying into ``out=``) runs when the transfer completes, as a
callback of the backend's future, so ``wait()`` and the future give the same finished tensor.

A backend without an asynchronous form runs the operation at the call and returns a handle
that is already complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["CollectiveHandle"]


class CollectiveHandle:
    """The result of a collective operation started with ``async_op=True``.

    Call `wait` once the result is needed: it blocks until the operation has completed on
    this rank and returns the result tensor (the ``out=`` tensor when one was given), or
    raises the operation's error (a backend timeout as `CollectiveTimeoutError`, as the
    synchronous form would). Every rank must still make the same collective calls in the
    same order; a pending operation counts from the call that started it.

    Handles are made by the collectives (`completed`, `after`), not by their users.
    """

    __slots__ = ("_callbacks", "_error", "_future", "_lock", "_result", "_settled")

    def __init__(self) -> None:
        self._future: torch.futures.Future[torch.Tensor] | None = None
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._settled = False
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, result: torch.Tensor) -> CollectiveHandle:
        """A handle whose operation has already completed with ``result``."""
        handle = cls()
        handle._result = result  # the future is made when asked for: most are only waited on
        handle._settled = True
        return handle

    @classmethod
    def after(
        cls,
        started: torch.futures.Future[Any],
        finish: Callable[[], torch.Tensor],
        errors: Callable[[], AbstractContextManager[None]],
    ) -> CollectiveHandle:
        """A handle that completes with ``finish()`` once the backend's ``started`` has.

        ``finish`` turns the reduced work buffer into the result; it runs as a callback of
        ``started`` (with the stream synchronisation torch gives a future's callbacks), so
        the handle's future holds the finished tensor. An error ``started`` completes with
        is raised again inside ``errors()``, which translates a backend's own error (a
        timeout) into accord's; `wait` raises the translated error itself.
        """
        handle = cls()

        def complete(done: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                try:
                    done.wait()
                except BaseException as raw:
                    with errors():
                        raise raw
                result = finish()
            except BaseException as err:
                # A callback's exception reaches the future as a RuntimeError holding its
                # text; the handle keeps the error itself for `wait`.
                handle._settle(err)
                raise
            handle._settle(None)
            return result

        handle._future = started.then(complete)
        return handle

    def _settle(self, error: BaseException | None) -> None:
        """Record the outcome and run the done callbacks, before the future completes."""
        with self._lock:
            self._error = error
            self._settled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(error)

    def wait(self) -> torch.Tensor:
        """Block until the operation has completed; return its result tensor.

        Raises:
            CollectiveTimeoutError: the backend timed out inside the operation.
            Exception: any other error of the operation, as the synchronous form raises it.
        """
        if self._future is None:
            assert self._result is not None
            return self._result
        try:
            return self._future.wait()
        except BaseException:
            if self._error is not None:
                raise self._error from None
            raise

    def is_completed(self) -> bool:
        """Whether the operation has completed (successfully or not); never blocks."""
        return self._future is None or bool(self._future.done())

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        """A `torch.futures.Future` that completes with the result tensor.

        For code that chains work on the result or waits on it itself, e.g. a DDP
        communication hook returning it.
        """
        if self._future is None:
            assert self._result is not None
            self._future = _completed_future(self._result)
        return self._future

    def add_done_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once the operation has completed (at once if it has).

        ``error`` is the operation's error, or None when it succeeded. Callbacks run before
        `wait` returns and before the future completes, possibly on a backend thread; they
        must not block or raise.
        """
        with self._lock:
            if not self._settled:
                self._callbacks.append(callback)
                return
            error = self._error
        callback(error)

    def __repr__(self) -> str:
        return f"CollectiveHandle({'completed' if self.is_completed() else 'pending'})"


def _completed_future(result: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``result`` (declared on ``result``'s CUDA device, if any)."""
    devices: list[int | str | torch.device] | None = (
        [result.device] if result.device.type == "cuda" else None
    )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    future.set_result(result)
    return future
