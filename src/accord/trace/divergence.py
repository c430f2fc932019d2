"""The first call where the ranks' recorded collectives differ."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from accord.trace.records import RankCalls

__all__ = ["Divergence", "describe_call", "first_divergence", "format_divergence"]

# What must agree between ranks at the same sequence number (not the barrier's name, not
# the line: correct code may call from two branches).
_KEY = ("op", "shape", "dtype", "arg")


@dataclass
class Divergence:
    """Where the ranks part.

    Attributes:
        seq: the sequence number of the first call that differs.
        expected: the call the other ranks were waiting in (or most ranks made).
        calls: each rank's call at ``seq`` (None: the rank never got there).
        missing: the ranks that did not make ``expected`` at ``seq``.
        no_dump: ranks that left no file (killed, or still running).
    """

    seq: int
    expected: dict[str, Any]
    calls: dict[int, dict[str, Any] | None]
    missing: list[int]
    no_dump: list[int] = field(default_factory=list)
    last_agreed: dict[int, dict[str, Any] | None] = field(default_factory=dict)


def _key(call: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(repr(call.get(name)) for name in _KEY)


def first_divergence(ranks: Sequence[RankCalls]) -> Divergence | None:
    """The first sequence number at which the ranks' calls differ, or None if none do.

    Calls are compared by op, shape, dtype and reduce op / root. A rank whose records end
    before that number never reached it. The expected call is the one a rank timed out
    waiting in, else the one most ranks made (rank order breaks a tie).
    """
    if not ranks:
        return None
    world = max([r.world_size or 0 for r in ranks] + [max(r.rank for r in ranks) + 1])
    present = {r.rank: r.group_calls for r in ranks}
    no_dump = [r for r in range(world) if r not in present]
    seqs = [seq for calls in present.values() for seq in calls]
    if not seqs:
        return None
    # Each ring buffer may have dropped its oldest calls: compare where every rank has some.
    start = max((min(calls) for calls in present.values() if calls), default=1)
    for seq in range(start, max(seqs) + 1):
        at = {rank: calls.get(seq) for rank, calls in sorted(present.items())}
        made = [call for call in at.values() if call is not None]
        if len(made) == len(at) and len({_key(call) for call in made}) == 1:
            continue
        expected = _expected(at)
        missing = [r for r, call in at.items() if call is None or _key(call) != _key(expected)]
        for call in made:
            if call.get("state") == "timeout" and _key(call) == _key(expected):
                for rank in _declared_missing(ranks, call):
                    if rank not in missing:
                        missing.append(rank)
        last = {
            rank: next((calls[s] for s in range(seq - 1, start - 1, -1) if s in calls), None)
            for rank, calls in present.items()
            if rank in missing
        }
        return Divergence(seq, expected, at, sorted(missing), no_dump, last)
    return _timed_out(ranks, present, no_dump)


def _timed_out(
    ranks: Sequence[RankCalls],
    present: dict[int, dict[int, dict[str, Any]]],
    no_dump: list[int],
) -> Divergence | None:
    """Where the kept records agree, but a rank timed out waiting for ranks that left no
    file: that call is where they part."""
    for entry in ranks:
        for seq, call in sorted(entry.group_calls.items()):
            if call.get("state") == "timeout":
                at: dict[int, dict[str, Any] | None] = {
                    rank: calls.get(seq) for rank, calls in sorted(present.items())
                }
                missing = sorted(set(entry.missing_ranks))
                return Divergence(seq, call, at, missing, no_dump, {})
    return None


def _expected(at: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    made = [(rank, call) for rank, call in at.items() if call is not None]
    for _, call in made:
        if call.get("state") == "timeout":
            return call
    counts = Counter(_key(call) for _, call in made)
    best = max(counts.values())
    return next(call for _, call in made if counts[_key(call)] == best)


def _declared_missing(ranks: Sequence[RankCalls], call: dict[str, Any]) -> list[int]:
    for rank in ranks:
        if any(c is call for c in rank.calls):
            return rank.missing_ranks
    return []


def describe_call(call: dict[str, Any]) -> str:
    """``op(shape, dtype, argument, name) [state] at site (step N)`` for one call."""
    parts = []
    if call.get("shape") is not None:
        parts.append(f"shape={tuple(call['shape'])}")
    if call.get("dtype"):
        parts.append(str(call["dtype"]))
    if call.get("arg") is not None:
        parts.append(f"arg={call['arg']}")
    if call.get("label"):
        parts.append(f"name={call['label']!r}")
    text = f"{call['op']}({', '.join(parts)}) [{call.get('state', '?')}] at {call.get('site')}"
    if call.get("via"):
        text += f" (via {call['via']})"
    if call.get("step") is not None:
        text += f" (step {call['step']})"
    return text


def format_divergence(divergence: Divergence | None, ranks: Sequence[RankCalls]) -> str:
    """A report of ``divergence`` for a terminal, with each rank's error line."""
    lines = []
    if divergence is None:
        lines.append("The ranks' recorded calls agree: no call where they differ.")
    else:
        seq, expected = divergence.seq, divergence.expected
        lines.append(
            f"First call where the ranks differ: #{seq}, {expected['op']} at {expected.get('site')}"
        )
        for rank, call in divergence.calls.items():
            shown = describe_call(call) if call is not None else "never got there"
            lines.append(f"  rank {rank}: {shown}")
        for rank in divergence.no_dump:
            lines.append(f"  rank {rank}: left no dump (killed, or still running)")
        lines.append(f"Ranks missing from {expected['op']} #{seq}: {divergence.missing}")
        for rank, call in divergence.last_agreed.items():
            before = f"#{call['seq']} {describe_call(call)}" if call is not None else "none kept"
            lines.append(f"  rank {rank}'s last call before it: {before}")
    errors = [(r.rank, r.error) for r in ranks if r.error]
    if errors:
        lines.append("Errors:")
        lines.extend(f"  rank {rank}: {error.splitlines()[0]}" for rank, error in errors)
    return "\n".join(lines)
