"""How XLA programs that hold a collective are started on ranks that may share a process
(see `accord.engines.xla.collective` for why): one launch at a time in a process
(`launch`), and a meeting of the process's ranks before each such program (`gate`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["gate", "launch"]

# The lock that makes ranks sharing a process launch programs one at a time.
_LAUNCH_LOCK = threading.Lock()
_GATES_LOCK = threading.Lock()

# Where the ranks of this process meet before a collective's program starts (by their
# number). XLA's in-process collectives wait 5 s for every device to arrive, warn, wait
# 10 s more and then abort the process (fixed in XLA, no flag), which xmp.spawn reports as
# "A process in the process pool was terminated abruptly". A rank 15 s behind its peer is
# no error (a busy machine, a program only it still has to compile), so the ranks first
# wait for each other here, for as long as any collective may wait.
_GATES: dict[int, threading.Barrier] = {}


def gate(parties: int) -> threading.Barrier:
    """The barrier where the ``parties`` ranks of this process meet before a program that
    holds a collective."""
    with _GATES_LOCK:
        barrier = _GATES.get(parties)
        if barrier is None:
            barrier = _GATES[parties] = threading.Barrier(parties)
        return barrier


def launch(tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Run the pending XLA work of ``tensors`` (default: everything on this rank's device).

    The program is launched under the process-wide lock and then awaited outside it, so
    ranks that share a process compile each program once and run the same executable,
    and no rank holds the lock while its device waits for the others. Use it instead of
    ``torch_xla.sync()`` wherever the pending work may hold a collective.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    # A sync that finds nothing to run still takes a device lock, and not this rank's
    # (torch_xla 2.9 was seen blocking on the device of a rank that waited in a collective
    # for this one: a deadlock). A pending zero on this device keeps the sync on it.
    anchor = torch.zeros((), device=device)
    with _LAUNCH_LOCK:
        if tensors is None:
            torch_xla.sync()
        else:
            torch_xla._XLAC._xla_sync_multi([*tensors, anchor], devices=[], wait=False)
            # The token chains collectives inside one program; a new program starts afresh.
            torch_xla._XLAC._set_all_reduce_token(str(device), None)
    xm.wait_device_ops(xm.xla_real_devices([str(device)]))
    del anchor
