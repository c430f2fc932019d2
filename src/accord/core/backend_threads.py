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

Tensors are not all a worker frees: each gloo op also keeps the calling thread's
thread-local state, and an op started inside a backward pass (DDP's and FSDP's gradient
reductions) holds a Python object there (autograd's context), which the worker drops
after the op completed, taking the GIL. Nothing tells when it has; so once a process has
used a group of several ranks (`settle_at_exit`), its exit first leaves the GIL free for
`EXIT_SETTLE_SECONDS`, time enough for a worker that finished its last op to let go.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections import deque

import torch

__all__ = ["EXIT_SETTLE_SECONDS", "RETURN_WAIT_SECONDS", "LentTensors", "settle_at_exit"]

RETURN_WAIT_SECONDS = 5.0
"""How long `LentTensors.collect` waits by default: an op that never completes keeps its
tensors, and the wait ends there."""

EXIT_SETTLE_SECONDS = 0.1
"""How long a process that used a multi-rank group sleeps at exit, after collecting what is
still lent, so that the backend's threads drop what they still hold while they may take
the GIL."""

# How many references a tensor's implementation has (its Python object holds one); where
# torch lacks it, tensors are handed over as they are.
_use_count = getattr(torch.Tensor, "_use_count", None)

_HOLDERS: weakref.WeakSet[LentTensors] = weakref.WeakSet()
_settle = False


def settle_at_exit() -> None:
    """Have this process sleep `EXIT_SETTLE_SECONDS` at exit, before the interpreter shuts
    down (a process group of several ranks calls it when it is set up)."""
    global _settle
    _settle = True


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
    """At exit, while threads may still take the GIL, wait for what is still lent, then
    leave the GIL free for a moment if a multi-rank group was used."""
    for holder in list(_HOLDERS):
        holder.collect()
    if _settle:
        time.sleep(EXIT_SETTLE_SECONDS)
