"""`LentTensors`: what a collective hands a backend's threads, kept until they let go of it.

torch.distributed's gloo runs each op on a worker thread, which frees the op's tensors
after the op has completed, not when the caller's wait returns. A tensor whose Python
object died before that must take the GIL there to be freed, and a thread that asks for
the GIL while the interpreter shuts down ends the whole process ("terminate called
without an active exception"), after a run that succeeded: now and then when the last op
of a run races the exit, always when an asynchronous op is left unfinished. A lent tensor
still belongs to Python, so the worker frees it without the GIL; `LentTensors.collect`
waits (sleeping, so a worker can take the GIL) until the backend holds none of them, and
at exit every holder still alive is collected.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections import deque

import torch

__all__ = ["RETURN_WAIT_SECONDS", "LentTensors"]

RETURN_WAIT_SECONDS = 5.0
"""How long `LentTensors.collect` waits by default: an op that never completes keeps its
tensors, and the wait ends there."""

# How many references a tensor's implementation has (its Python object holds one); where
# torch lacks it, tensors are handed over as they are.
_use_count = getattr(torch.Tensor, "_use_count", None)

_HOLDERS: weakref.WeakSet[LentTensors] = weakref.WeakSet()


class LentTensors:
    """The tensors handed to a backend's ops, each kept until the backend lets go of it."""

    def __init__(self) -> None:
        self._lent: deque[torch.Tensor] = deque()
        _HOLDERS.add(self)

    def lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """An alias of ``tensor`` (same memory) to pass to the backend, kept here."""
        if _use_count is None:
            return tensor
        lent = self._lent
        while lent and _use_count(lent[0]) == 1:  # the backend let go of the oldest
            lent.popleft()
        alias = tensor.detach()
        lent.append(alias)
        return alias

    def collect(self, wait: float = RETURN_WAIT_SECONDS) -> None:
        """Wait until the backend holds none of the lent tensors, at most ``wait`` seconds;
        then forget them."""
        lent = self._lent
        deadline = time.monotonic() + wait
        while _use_count is not None and any(_use_count(t) > 1 for t in list(lent)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        lent.clear()


@atexit.register
def _collect_all() -> None:
    """At exit, while threads may still take the GIL, wait for what is still lent."""
    for holder in list(_HOLDERS):
        holder.collect()
