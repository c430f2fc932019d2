"""``python -m accord.trace DIR [--summary]``: the first call where the ranks differ."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from accord.trace.divergence import first_divergence, format_divergence
from accord.trace.records import TraceFormatError, load
from accord.trace.summary import format_summary, summarize

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (0, or 2 when nothing could be read)."""
    parser = argparse.ArgumentParser(
        prog="python -m accord.trace",
        description=(
            "Compare the collective calls each rank recorded (the collectives-rank<N>.json "
            "files a watchdog timeout or a mismatch leaves, or a collective-timeline-*.json "
            "trace) and print the first call where the ranks differ."
        ),
    )
    parser.add_argument("path", help="the directory holding the files, or one file")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print calls, bytes, time and waiting per rank and op, and name the straggler",
    )
    args = parser.parse_args(argv)
    try:
        ranks = load(args.path)
    except TraceFormatError as err:
        print(f"accord.trace: {err}", file=sys.stderr)
        return 2
    print(f"Read ranks {[r.rank for r in ranks]} from {args.path}")
    if args.summary:
        print(format_summary(summarize(ranks)))
    else:
        print(format_divergence(first_divergence(ranks), ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
