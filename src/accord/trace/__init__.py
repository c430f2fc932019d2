"""Read the collective calls the ranks recorded: where they part, and who is slow.

``python -m accord.trace DIR`` reads the per-rank files a watchdog timeout or a mismatch
leaves (``collectives-rank<N>.json``) and prints the first call where the ranks differ;
``--summary`` prints, per rank and op, calls, bytes, time, and time spent waiting for the
slowest rank, and names the straggler. It also reads the Chrome trace
``Trainer(profiler="timeline")`` writes.
"""

from __future__ import annotations

from accord.trace.divergence import (
    Divergence,
    describe_call,
    first_divergence,
    format_divergence,
)
from accord.trace.records import RankCalls, TraceFormatError, load
from accord.trace.summary import OpSummary, Summary, format_summary, summarize

__all__ = [
    "Divergence",
    "OpSummary",
    "RankCalls",
    "Summary",
    "TraceFormatError",
    "describe_call",
    "first_divergence",
    "format_divergence",
    "format_summary",
    "load",
    "summarize",
]
