"""A recorder's settings and files: per-rank dumps, their directory, the merged timeline.

Holds the environment settings (``ACCORD_TRACE_DIR``, ``ACCORD_TRACE_CAPACITY``) and the
dump format constants, `trace_dir` and `dump_path` (where a rank's dump goes),
`merge_timeline` (every rank's records as one Chrome trace) and the atomic JSON writer they
share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accord.core.env_vars import env_number

__all__ = [
    "CAPACITY_ENV_VAR",
    "DEFAULT_CAPACITY",
    "DEFAULT_TRACE_DIR",
    "DUMP_FORMAT",
    "TRACE_DIR_ENV_VAR",
    "dump_path",
    "merge_timeline",
    "trace_dir",
]

TRACE_DIR_ENV_VAR = "ACCORD_TRACE_DIR"
"""Directory the per-rank dumps go to; setting it also turns recording on."""

CAPACITY_ENV_VAR = "ACCORD_TRACE_CAPACITY"
"""How many calls each rank keeps for a dump (the ring buffer's size)."""

DEFAULT_CAPACITY = 512
"""Calls kept per rank when ``ACCORD_TRACE_CAPACITY`` is not set."""

DEFAULT_TRACE_DIR = "accord_traces"
"""Where dumps go (relative to the working directory) when no directory was chosen."""

DUMP_FORMAT = "accord-collective-calls"
"""The ``format`` field of a per-rank dump file."""

_DUMP_VERSION = 1


def _capacity_from_env() -> int:
    return env_number(
        CAPACITY_ENV_VAR,
        int,
        DEFAULT_CAPACITY,
        positive=True,
        unit="calls",
        hint=f"use e.g. {DEFAULT_CAPACITY}",
    )


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("w", encoding="utf-8") as stream:
        json.dump(payload, stream)
        stream.flush()
        os.fsync(stream.fileno())
    temporary.replace(path)


def trace_dir(directory: str | Path | None = None) -> Path:
    """Where dumps go: ``ACCORD_TRACE_DIR``, else ``directory`` (the Trainer passes the
    run's log directory, or `DEFAULT_TRACE_DIR` under ``default_root_dir`` without a
    logger), else `DEFAULT_TRACE_DIR` under the working directory."""
    chosen = os.environ.get(TRACE_DIR_ENV_VAR, "").strip()
    if chosen:
        return Path(chosen)
    if directory is not None:
        return Path(directory)
    return Path.cwd() / DEFAULT_TRACE_DIR


def dump_path(directory: str | Path, rank: int) -> Path:
    """The file rank ``rank`` dumps its calls to in ``directory``."""
    return Path(directory) / f"collectives-rank{rank}.json"


def merge_timeline(gathered: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write `RecordingCollective.gather_records`' result as one Chrome trace JSON file.

    A process (``pid``) and thread (``tid``) per rank, named ``rank N``; a complete event
    (``ph: "X"``) per call, its arguments (sequence number, step, shape, dtype, bytes,
    call site) under ``args``. Times are microseconds from the first call. Open the file
    in https://ui.perfetto.dev or ``chrome://tracing``. Written atomically.
    """
    entries = list(gathered)
    starts = [call["start"] for entry in entries for call in entry["calls"]]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for entry in entries:
        rank = int(entry["rank"])
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": rank,
             "args": {"name": f"rank {rank}"}}
        )  # fmt: skip
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": rank,
             "args": {"sort_index": rank}}
        )  # fmt: skip
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": rank,
             "args": {"name": f"rank {rank} collectives"}}
        )  # fmt: skip
        for call in entry["calls"]:
            end = call["end"] if call["end"] is not None else call["start"]
            name = call["op"] if not call["label"] else f"{call['op']} {call['label']}"
            args = {key: call[key] for key in _TRACE_ARGS}
            args["rank"] = rank
            events.append(
                {
                    "name": name,
                    "cat": "collective",
                    "ph": "X",
                    "pid": rank,
                    "tid": rank,
                    "ts": (call["start"] - origin) * 1e6,
                    "dur": max(end - call["start"], 0.0) * 1e6,
                    "args": args,
                }
            )
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": "accord collective timeline",
            "clock_offsets_s": {str(e["rank"]): e["offset"] for e in entries},
            "dropped_calls": {str(e["rank"]): e["dropped"] for e in entries},
        },
    }
    target = Path(path)
    _write_json(target, trace)
    return target


_TRACE_ARGS = ("seq", "step", "op", "shape", "dtype", "bytes", "arg", "label", "site", "via",
               "state", "start", "end")  # fmt: skip
