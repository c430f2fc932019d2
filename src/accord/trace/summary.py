"""Per rank and op: calls, bytes, time spent, and time spent waiting for the slowest rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from accord.trace.records import RankCalls

__all__ = ["OpSummary", "Summary", "format_summary", "summarize"]


@dataclass
class OpSummary:
    """One op on one rank.

    Attributes:
        calls: calls made.
        bytes: bytes handed in.
        seconds: time inside the calls.
        waiting: of ``seconds``, the part spent waiting for a slower rank: per call, this
            rank's time minus the shortest time any rank spent in the same call (the
            rank that arrived last waits least). Needs no clock shared between ranks.
    """

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    waiting: float = 0.0


@dataclass
class Summary:
    """`OpSummary` per rank and op, and the rank the others waited for most.

    Attributes:
        ops: ``{rank: {op: OpSummary}}``.
        waited_for: per rank, the seconds the other ranks spent waiting for it (summed
            over calls where it arrived last).
        straggler: the rank the others waited for most, or None (one rank, no waiting).
    """

    ops: dict[int, dict[str, OpSummary]] = field(default_factory=dict)
    waited_for: dict[int, float] = field(default_factory=dict)
    straggler: int | None = None


def summarize(ranks: Sequence[RankCalls]) -> Summary:
    """Total every rank's finished calls per op and find the straggler."""
    summary = Summary()
    # seq -> rank -> (op, seconds) of the finished calls.
    durations: dict[int, dict[int, tuple[str, float]]] = {}
    for entry in ranks:
        per_op = summary.ops.setdefault(entry.rank, {})
        summary.waited_for.setdefault(entry.rank, 0.0)
        for call in entry.calls:
            if call.get("end") is None:
                continue
            seconds = max(float(call["end"]) - float(call["start"]), 0.0)
            row = per_op.setdefault(call["op"], OpSummary())
            row.calls += 1
            row.bytes += int(call.get("bytes") or 0)
            row.seconds += seconds
            if call.get("seq") is not None:
                durations.setdefault(int(call["seq"]), {})[entry.rank] = (call["op"], seconds)
    everyone = {entry.rank for entry in ranks}
    for by_rank in durations.values():
        # Only a call every rank made, the same op everywhere: where the ranks' calls
        # differ (a desync) they were not waiting for each other in one call.
        if set(by_rank) != everyone or len(by_rank) < 2:
            continue
        if len({op for op, _ in by_rank.values()}) > 1:
            continue
        last_in = min(by_rank, key=lambda rank: (by_rank[rank][1], rank))
        shortest = by_rank[last_in][1]
        for rank, (op, seconds) in by_rank.items():
            summary.ops[rank][op].waiting += seconds - shortest
            summary.waited_for[last_in] += seconds - shortest
    if summary.waited_for and len(everyone) > 1:
        rank = max(summary.waited_for, key=lambda r: (summary.waited_for[r], -r))
        if summary.waited_for[rank] > 0:
            summary.straggler = rank
    return summary


def format_summary(summary: Summary) -> str:
    """The summary as an aligned table per rank, with the straggler named below."""
    header = ("rank", "op", "calls", "bytes", "time s", "waiting s", "waiting %")
    rows = []
    for rank, per_op in sorted(summary.ops.items()):
        for op, row in sorted(per_op.items(), key=lambda item: (-item[1].seconds, item[0])):
            share = 100 * row.waiting / row.seconds if row.seconds else 0.0
            rows.append(
                (
                    str(rank),
                    op,
                    str(row.calls),
                    str(row.bytes),
                    f"{row.seconds:.4f}",
                    f"{row.waiting:.4f}",
                    f"{share:.0f}",
                )
            )
    widths = [max(len(line[i]) for line in (header, *rows)) for i in range(len(header))]

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 1 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        )

    lines = [fmt(header), "-" * len(fmt(header)), *(fmt(row) for row in rows)]
    if summary.straggler is not None:
        lines.append(
            f"Straggler: rank {summary.straggler}; the other ranks spent "
            f"{summary.waited_for[summary.straggler]:.4f} s waiting for it in collectives."
        )
    else:
        lines.append("No straggler: no rank waited for another.")
    return "\n".join(lines)
