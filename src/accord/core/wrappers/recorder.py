"""`RecordingCollective`: the last calls of a run, per rank, for a timeline or a hang's dump.

A recorder keeps, in a bounded ring buffer (`CallRecord` entries), every public operation a
collective was asked for: op, sequence number, shape, dtype, bytes, start and end time, the
user's call site and the training step. It serves two purposes:

* ``Trainer(profiler="timeline")`` records every call of a run and merges all ranks'
  records into one Chrome trace (`merge_timeline`), opened in https://ui.perfetto.dev or
  ``chrome://tracing``.
* When the watchdog gives up on a call or a desync is detected
  (`CollectiveTimeoutError`, `CollectiveMismatchError`), each rank writes its last calls to a
  per-rank file (`dump_path`) and the error message names it; ``python -m accord.trace DIR``
  then prints the first call where the ranks differ.

Strategies get a recorder closest to the backend whenever the debug check or the watchdog is
on, or ``ACCORD_TRACE_DIR`` is set (`accord.core.wrappers.policy.maybe_record`). Off, there is
no recorder layer at all.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from typing_extensions import override

from accord.core.collective import Collective, CollectiveHandle
from accord.core.env_vars import env_number
from accord.core.wrappers.call_record import CallRecord, _call_site, _state_of
from accord.core.wrappers.trace_files import (
    _DUMP_VERSION,
    DUMP_FORMAT,
    _capacity_from_env,
    _write_json,
    dump_path,
    trace_dir,
)

# accord.trainer.run imports these two from here.
from accord.core.wrappers.wrapper import CallSite, CollectiveWrapper, OpCall
from accord.errors import CollectiveError, ConfigurationError

__all__ = ["RecordingCollective", "find_recorder", "leave_trace"]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=BaseException)

_CLOCK_ROUNDS = 5


class RecordingCollective(CollectiveWrapper):
    """A collective that keeps its last ``capacity`` calls in a ring buffer.

    Each public operation adds a `CallRecord`; an asynchronous one (``async_op=True``) ends
    when its operation completes, and is ``"running"`` until then. Recording walks the stack
    once per call, up to the first frame outside accord, and takes two clock readings: a few
    microseconds a call (``benchmarks/README.md`` has the figure). The records are this rank's only; the
    ranks' records are merged by `merge_timeline` or, after a failure, compared by
    ``python -m accord.trace``.

    Args:
        inner: the collective to record (any backend).
        capacity: calls kept (the oldest are dropped); default ``ACCORD_TRACE_CAPACITY``,
            else `DEFAULT_CAPACITY`.
        directory: where `dump` writes (default: `trace_dir`).
        step_source: returns the current training step; the Trainer sets it.
    """

    def __init__(
        self,
        inner: Collective,
        capacity: int | None = None,
        *,
        directory: str | Path | None = None,
        step_source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(inner)
        size = _capacity_from_env() if capacity is None else capacity
        if size < 1:
            raise ConfigurationError(f"capacity={capacity} must be a positive number of calls.")
        self._records: deque[CallRecord] = deque(maxlen=size)
        self._calls = 0
        self._recorded = 0
        self.directory = None if directory is None else Path(directory)
        self.step_source = step_source

    def __getstate__(self) -> dict[str, Any]:
        # A step source usually closes over a Trainer: it belongs to one process.
        state = self.__dict__.copy()
        state["step_source"] = None
        return state

    # ------------------------------------------------------------------ the ring
    @property
    def capacity(self) -> int:
        """How many calls are kept."""
        maxlen = self._records.maxlen
        assert maxlen is not None
        return maxlen

    @capacity.setter
    def capacity(self, size: int) -> None:
        if size < 1:
            raise ConfigurationError(f"capacity={size} must be a positive number of calls.")
        self._records = deque(self._records, maxlen=size)

    @property
    def records(self) -> list[CallRecord]:
        """The kept calls, oldest first."""
        return list(self._records)

    @property
    def dropped(self) -> int:
        """Calls recorded but no longer kept (the ring buffer overflowed)."""
        return self._recorded - len(self._records)

    def reset(self) -> None:
        """Forget every record; sequence numbers go on (they must match across ranks)."""
        self._records.clear()
        self._recorded = 0

    # ------------------------------------------------------------------ the hook
    @override
    def _run(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        record = self._begin(call)
        try:
            result = perform()
        except BaseException as err:
            record.end = time.perf_counter()
            record.state = _state_of(err, self._inner.rank)
            if record.state != "failed":
                self.dump_on_error(err)
            raise
        if isinstance(result, CollectiveHandle):
            # An asynchronous call ends when its operation completes, not when it returns.
            result.add_done_callback(functools.partial(self._complete, record))
            return result
        record.end = time.perf_counter()
        record.state = "ok"
        return result

    def _complete(self, record: CallRecord, error: BaseException | None) -> None:
        """Close ``record`` of an asynchronous call that completed (with ``error``)."""
        record.end = time.perf_counter()
        if error is None:
            record.state = "ok"
            return
        record.state = _state_of(error, self._inner.rank)
        if record.state != "failed":
            self.dump_on_error(error)  # the error `wait` raises names the file

    def _begin(self, call: OpCall, site: CallSite | None = None) -> CallRecord:
        if call.is_point_to_point:
            seq = None
        else:
            self._calls += 1
            seq = self._calls
        if site is None:
            site, via = _call_site()
        else:
            via = None
        source = self.step_source
        record = CallRecord(seq, call, site, via, None if source is None else source(), 0.0)
        self._records.append(record)
        self._recorded += 1
        record.start = time.perf_counter()
        return record

    def record_failure(self, call: OpCall, error: BaseException, site: CallSite | None) -> None:
        """Add the call an outer check refused (it never reached this layer) as failed."""
        record = self._begin(call, site)
        record.end = record.start
        record.state = _state_of(error, self._inner.rank)

    def dump_on_error(self, error: BaseException) -> Path | None:
        """`dump` this rank's calls for ``error`` and name the file at the end of its message.

        Does nothing (and returns None) when the error already names a dump. A dump that
        cannot be written is said in the message instead.
        """
        if getattr(error, "trace_file", None) is not None:
            return None  # another recorder already wrote this rank's calls
        try:
            path = self.dump(error)
        except OSError as err:
            _append(error, f"This rank's last collective calls could not be written: {err}.")
            return None
        error.trace_file = path  # type: ignore[attr-defined]
        _append(
            error,
            f"Rank {self._inner.rank}'s last {len(self._records)} collective calls are in "
            f"{path}; `python -m accord.trace {path.parent}` compares every rank's file "
            "and prints the first call where the ranks differ.",
        )
        return path

    def share_directory(self, directory: str | Path) -> Path:
        """Make rank 0's ``directory`` the dump directory of every rank, and return it.

        Every rank must call it, after setup. The exchange runs on this layer's primitives,
        so it is not recorded, checked or watched.
        """
        chosen = str(directory)
        if self._inner.is_setup and self._inner.world_size > 1:
            chosen = Collective.broadcast_object(self, chosen, 0)
        self.directory = Path(chosen)
        return self.directory

    def _gather_bytes(self, obj: Any) -> list[bytes]:
        """Every rank's pickled ``obj``: the sizes, then the padded bytes, on the primitives."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        device = self.object_device
        world_size = self._inner.world_size
        sizes = torch.empty((world_size, 1), dtype=torch.int64, device=device)
        self._all_gather_into(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=device))
        lengths = [int(n) for n in sizes.flatten().tolist()]
        row = torch.zeros(max(lengths), dtype=torch.uint8)
        row[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = torch.empty((world_size, max(lengths)), dtype=torch.uint8, device=device)
        self._all_gather_into(rows, row.to(device))
        host = rows.cpu().contiguous()
        return [_tensor_bytes(host[r, :n].contiguous()) for r, n in enumerate(lengths)]

    # ------------------------------------------------------------------ dumps
    def dump(self, error: BaseException | None = None, directory: str | Path | None = None) -> Path:
        """Write this rank's kept calls to `dump_path` (atomically) and return the path.

        Args:
            error: what ended the run, written along (its message, and the ranks a
                watchdog timeout names as missing).
            directory: where to write (default: ``directory``, else `trace_dir`).
        """
        rank = self._inner.rank if self._inner.is_setup else env_number("RANK", int, 0)
        world_size = self._inner.world_size if self._inner.is_setup else None
        folder = Path(directory) if directory is not None else trace_dir(self.directory)
        anchor = time.time() - time.perf_counter()
        payload = {
            "format": DUMP_FORMAT,
            "version": _DUMP_VERSION,
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "host": os.uname().nodename if hasattr(os, "uname") else "",
            "clock": "perf_counter seconds; add wall_offset for Unix time",
            "wall_offset": anchor,
            "capacity": self.capacity,
            "dropped": self.dropped,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "missing_ranks": list(getattr(error, "missing_ranks", []) or []),
            "calls": [record.as_dict() for record in self._records],
        }
        path = dump_path(folder, rank)
        _write_json(path, payload)
        return path

    # ------------------------------------------------------------------ timeline
    def gather_records(self) -> list[dict[str, Any]] | None:
        """Every rank's records, with clock offsets removed, on every rank (one gather).

        Every rank must call it. The ranks first pass ``5`` barriers; the median difference
        of their exit times estimates each rank's clock offset from rank 0. The barriers
        and the gather (one all-gather of the sizes, one of the pickled records) run on
        this layer's primitives, so they are not recorded, checked
        or watched. Returns one entry per rank: ``rank``, ``offset`` (seconds),
        ``dropped`` and ``calls`` (`CallRecord.as_dict` on rank 0's clock); None on a
        collective that is not set up.
        """
        if not self._inner.is_setup:
            return None
        exits = []
        for _ in range(_CLOCK_ROUNDS):
            self._barrier()
            exits.append(time.perf_counter())
        mine = {
            "rank": self._inner.rank,
            "exits": exits,
            "dropped": self.dropped,
            "calls": [record.as_dict() for record in self._records],
        }
        gathered: list[dict[str, Any]] = [pickle.loads(b) for b in self._gather_bytes(mine)]
        reference = gathered[0]["exits"]
        for entry in gathered:
            offset = statistics.median(
                a - b for a, b in zip(entry.pop("exits"), reference, strict=True)
            )
            entry["offset"] = offset
            for call in entry["calls"]:
                call["start"] -= offset
                if call["end"] is not None:
                    call["end"] -= offset
        return gathered


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU uint8 tensor, copied in one call (not byte by byte)."""
    return ctypes.string_at(tensor.data_ptr(), tensor.numel())


def _append(error: BaseException, text: str) -> None:
    first = error.args[0] if error.args else ""
    error.args = (f"{first}\n{text}", *error.args[1:])


def find_recorder(collective: Collective) -> RecordingCollective | None:
    """The `RecordingCollective` layer of ``collective`` (itself or any it wraps), or None."""
    layer: Collective = collective
    while not isinstance(layer, RecordingCollective):
        if not isinstance(layer, CollectiveWrapper):
            return None
        layer = layer.inner
    return layer


def leave_trace(
    layer: CollectiveWrapper, call: OpCall, error: _E, site: CallSite | None = None
) -> _E:
    """Record ``call``, which ``layer`` refused with ``error``, and dump this rank's calls.

    For checks that sit outside the recorder (the debug check, the watchdog): the call
    never reached the recorder, so it is added as failed, the rank's calls are written to
    `dump_path`, and the file is named at the end of ``error``'s message. Without a
    recorder inside ``layer`` the error is returned unchanged.
    """
    recorder = find_recorder(layer.inner)
    if recorder is not None and isinstance(error, CollectiveError):
        recorder.record_failure(call, error, site)
        recorder.dump_on_error(error)
    return error
