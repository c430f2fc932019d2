"""Read what the ranks recorded: per-rank dump files, or a merged timeline."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accord.core.wrappers.trace_files import DUMP_FORMAT

__all__ = ["RankCalls", "TraceFormatError", "load"]


class TraceFormatError(ValueError):
    """A path holds no accord trace, or a file that is not one."""


@dataclass
class RankCalls:
    """One rank's recorded calls (`accord.core.wrappers.call_record.CallRecord.as_dict` each).

    Attributes:
        rank: the rank.
        world_size: the ranks in the job (None when the file does not say).
        calls: the calls, oldest first.
        error: what ended the run on this rank, as ``"Type: message"``, if anything.
        missing_ranks: the ranks a watchdog timeout on this rank named as missing.
        source: the file read.
    """

    rank: int
    world_size: int | None
    calls: list[dict[str, Any]]
    error: str | None = None
    missing_ranks: list[int] = field(default_factory=list)
    source: Path | None = None

    @property
    def group_calls(self) -> dict[int, dict[str, Any]]:
        """The group operations by sequence number (send/recv have none)."""
        return {call["seq"]: call for call in self.calls if call.get("seq") is not None}


def load(path: str | Path) -> list[RankCalls]:
    """Every rank's calls under ``path``, in rank order.

    ``path`` is a directory holding ``collectives-rank<N>.json`` dumps (what a rank leaves
    after a watchdog timeout or a mismatch) or a ``collective-timeline-*.json`` trace
    (what ``Trainer(profiler="timeline")`` writes), or one such file.

    Raises:
        TraceFormatError: nothing readable at ``path``; the message says what was looked for.
    """
    target = Path(path)
    if not target.exists():
        raise TraceFormatError(f"{target} does not exist; pass the directory the dumps are in.")
    if target.is_file():
        return _load_file(target)
    dumps = sorted(target.glob("collectives-rank*.json"))
    if dumps:
        ranks = [rank for dump in dumps for rank in _load_file(dump)]
        return sorted(ranks, key=lambda r: r.rank)
    timelines = sorted(target.glob("collective-timeline-*.json"))
    if timelines:
        return _load_file(timelines[-1])
    raise TraceFormatError(
        f"{target} holds no collectives-rank<N>.json dump and no collective-timeline-*.json "
        "trace. Dumps are written where ACCORD_TRACE_DIR points, else to the run's log "
        "directory, else to ./accord_traces."
    )


def _load_file(path: Path) -> list[RankCalls]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceFormatError(f"{path} is not a readable JSON file: {err}.") from err
    if isinstance(data, dict) and data.get("format") == DUMP_FORMAT:
        return [
            RankCalls(
                rank=int(data["rank"]),
                world_size=data.get("world_size"),
                calls=list(data.get("calls", [])),
                error=data.get("error"),
                missing_ranks=[int(r) for r in data.get("missing_ranks", [])],
                source=path,
            )
        ]
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for event in data["traceEvents"]:
            if event.get("ph") == "M":
                by_rank.setdefault(int(event["pid"]), [])
            elif event.get("ph") == "X" and event.get("cat") == "collective":
                by_rank.setdefault(int(event["pid"]), []).append(dict(event["args"]))
        world_size = len(by_rank)
        return [
            RankCalls(rank, world_size, sorted(calls, key=lambda c: c["start"]), source=path)
            for rank, calls in sorted(by_rank.items())
        ]
    raise TraceFormatError(
        f"{path} is neither an accord dump (format {DUMP_FORMAT!r}) nor a Chrome trace "
        "with traceEvents."
    )
