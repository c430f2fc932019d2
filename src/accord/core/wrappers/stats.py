"""`InstrumentedCollective`: count the collective calls of a run and the time they take.

Wrap any collective and read, at the end of a fit, how many times each operation ran on
this rank, how long it took in total and how many bytes it was handed::

    collective = InstrumentedCollective(TorchCollective())
    ...
    print(collective.stats.format_table())
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from typing_extensions import override

from accord.core.collective import Collective, CollectiveHandle
from accord.core.wrappers.wrapper import CollectiveWrapper, OpCall

__all__ = ["CollectiveStats", "InstrumentedCollective", "OpStats"]

_T = TypeVar("_T")


@dataclass
class OpStats:
    """The totals of one operation on one rank."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    errors: int = 0

    @property
    def mean_seconds(self) -> float:
        """Average seconds per call (0 when never called)."""
        return self.seconds / self.calls if self.calls else 0.0


class CollectiveStats:
    """Calls, seconds, bytes and errors per operation name, on this rank.

    Filled by `InstrumentedCollective`; `record` can also be called directly.
    """

    def __init__(self) -> None:
        self._ops: dict[str, OpStats] = {}

    def record(self, op: str, seconds: float, nbytes: int = 0, *, failed: bool = False) -> None:
        """Add one call of ``op`` that took ``seconds`` and was handed ``nbytes`` bytes."""
        entry = self._ops.get(op)
        if entry is None:
            entry = self._ops[op] = OpStats()
        entry.calls += 1
        entry.seconds += seconds
        entry.bytes += nbytes
        if failed:
            entry.errors += 1

    def __getitem__(self, op: str) -> OpStats:
        """The totals of ``op`` (all zero when it was never called)."""
        return self._ops.get(op, OpStats())

    def __contains__(self, op: object) -> bool:
        return op in self._ops

    @property
    def total_calls(self) -> int:
        """Calls of every operation together."""
        return sum(entry.calls for entry in self._ops.values())

    @property
    def total_seconds(self) -> float:
        """Seconds spent in every operation together."""
        return sum(entry.seconds for entry in self._ops.values())

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._ops.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per operation name (most time first): ``calls``, ``seconds``, ``mean_ms``,
        ``bytes`` and ``errors``."""
        ordered = sorted(self._ops.items(), key=lambda item: (-item[1].seconds, item[0]))
        return {
            op: {
                "calls": entry.calls,
                "seconds": entry.seconds,
                "mean_ms": entry.mean_seconds * 1e3,
                "bytes": entry.bytes,
                "errors": entry.errors,
            }
            for op, entry in ordered
        }

    def format_table(self, title: str | None = "Collective calls") -> str:
        """The summary as an aligned text table, with a total row, for printing."""
        header = ("op", "calls", "total s", "mean ms", "MiB", "errors")
        rows = [
            (
                op,
                str(int(row["calls"])),
                f"{row['seconds']:.4f}",
                f"{row['mean_ms']:.3f}",
                f"{row['bytes'] / 2**20:.2f}",
                str(int(row["errors"])),
            )
            for op, row in self.summary().items()
        ]
        total_bytes = sum(entry.bytes for entry in self._ops.values())
        total_errors = sum(entry.errors for entry in self._ops.values())
        calls = self.total_calls
        mean_ms = self.total_seconds / calls * 1e3 if calls else 0.0
        rows.append(
            (
                "total",
                str(calls),
                f"{self.total_seconds:.4f}",
                f"{mean_ms:.3f}",
                f"{total_bytes / 2**20:.2f}",
                str(total_errors),
            )
        )
        widths = [max(len(line[i]) for line in (header, *rows)) for i in range(len(header))]

        def fmt(line: tuple[str, ...]) -> str:
            cells = [cell.rjust(w) for cell, w in zip(line[1:], widths[1:], strict=True)]
            return "  ".join([line[0].ljust(widths[0]), *cells])

        rule = "-" * len(fmt(header))
        lines = [fmt(header), rule, *(fmt(row) for row in rows[:-1]), rule, fmt(rows[-1])]
        if title:
            lines.insert(0, title)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CollectiveStats(calls={self.total_calls}, seconds={self.total_seconds:.4f})"


class InstrumentedCollective(CollectiveWrapper):
    """A collective that records every public operation's calls and wall time in `stats`.

    Times are this rank's host wall time around the call (waiting for slower ranks
    included). CUDA collectives may return before the device finishes; pass
    ``synchronize=True`` to wait for the device so the time covers the transfer. Bytes are
    the sizes of the tensors handed in (0 for barrier and object ops). Calls that raise
    are counted, and also counted in ``errors``. An asynchronous call (``async_op=True``)
    is recorded when its operation completes, with the time from its start to then.

    Args:
        inner: the collective to measure.
        stats: where to record (default: a new `CollectiveStats`); share one between
            collectives to total them.
        synchronize: call ``torch.cuda.synchronize()`` after ops on CUDA tensors.
    """

    def __init__(
        self,
        inner: Collective,
        stats: CollectiveStats | None = None,
        *,
        synchronize: bool = False,
    ) -> None:
        super().__init__(inner)
        self.stats = stats if stats is not None else CollectiveStats()
        self.synchronize = synchronize

    def summary(self) -> dict[str, dict[str, float]]:
        """`CollectiveStats.summary` of this collective's `stats`."""
        return self.stats.summary()

    def format_table(self, title: str | None = "Collective calls") -> str:
        """`CollectiveStats.format_table` of this collective's `stats`."""
        return self.stats.format_table(title)

    @override
    def _run(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        tensor = call.tensor
        is_tensor = isinstance(tensor, torch.Tensor)
        nbytes = tensor.numel() * tensor.element_size() if is_tensor else 0
        start = time.perf_counter()
        try:
            result = perform()
            synchronous = not isinstance(result, CollectiveHandle)
            if synchronous and self.synchronize and is_tensor and tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
        except BaseException:
            self.stats.record(call.op, time.perf_counter() - start, nbytes, failed=True)
            raise
        if isinstance(result, CollectiveHandle):
            # An asynchronous call counts from its start to its completion.
            result.add_done_callback(functools.partial(self._complete, call.op, start, nbytes))
        else:
            self.stats.record(call.op, time.perf_counter() - start, nbytes)
        return result

    def _complete(self, op: str, start: float, nbytes: int, error: BaseException | None) -> None:
        """Record an asynchronous call of ``op`` that completed (with ``error``)."""
        self.stats.record(op, time.perf_counter() - start, nbytes, failed=error is not None)
