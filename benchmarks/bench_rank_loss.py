"""What ``Trainer(on_rank_loss="continue")`` costs, and how soon a fit goes on after a loss.

Every fit is the benchmark MLP of ``common.py`` with ``strategy="ddp_fork"``: this process
forks the ranks (under ``"continue"`` it also serves the rendezvous store, so any rank may
be lost), and the ddp_fork launcher sets each rank's ``torch.set_num_threads`` from
``OMP_NUM_THREADS`` (1 under ``run.py``; else the cores divided among the ranks, also 1 on
2 cores). A callback in the ranks takes the timestamps and counts and writes them to files.
The loader has no generator of its own: ``"continue"`` must rebuild the epoch's order.

* **Per-step cost with no failure**: ddp x2, ``on_rank_loss="continue"`` vs ``"fail"``
  (the default), one fit per contestant and round, interleaved (`common.interleave`). A
  sample runs from ``on_train_epoch_start`` of epoch 1 to ``on_train_end``, per step, the
  slower rank's. Counted in fits of their own, not timed, over `COUNTED` steps from step
  `COUNT_FROM`: Python calls per step on each rank's training thread (``sys.setprofile``,
  as ``bench_calls.py``) and ``torch.distributed`` collectives per step (outermost calls,
  as ``bench_logging.py``; DDP's gradient all-reduce runs in C++ and is not counted).
* **Loss to the next committed step**: ddp x4 under ``"continue"``; rank `VICTIM` writes
  ``time.time()`` and sends itself SIGKILL in ``on_train_batch_start`` of step `KILL_AT`.
  A survivor commits a step at its ``on_train_batch_end``; a sample runs from the kill to
  the commit of step `KILL_AT` + 1 on the slower survivor. Then the same with SIGSTOP
  (the rank freezes) under ``ACCORD_COLLECTIVE_TIMEOUT=5``: the survivors learn of it when
  their wait times out, so that figure includes the timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from bench_fit import AccordMlp
from bench_logging import COUNTER
from common import (
    BATCH_SIZE,
    SAMPLES,
    emit,
    interleave,
    make_dataset,
    parser,
    section,
    set_threads,
)
from torch.utils.data import DataLoader

import accord
from accord.callbacks import Callback
from accord.core.regroup import STALE_SECONDS

EPOCHS = 4  # per timed fit; epoch 0 is a warm-up
COUNT_FROM, COUNTED = 10, 50
VICTIM, KILL_AT = 2, 15


class Probe(Callback):
    """Takes one rank's timestamps and counts; writes them to ``<folder>/rank<N>.json``.

    Args:
        folder: where each rank writes its file.
        count: ``"calls"`` or ``"collectives"``: count them over `COUNTED` steps.
        kill: ``(rank, step, signal)``: that rank sends itself the signal at that step.
    """

    def __init__(
        self, folder: Path, count: str | None = None, kill: tuple[int, int, int] | None = None
    ) -> None:
        self.folder, self.count, self.kill = folder, count, kill
        self.result: dict[str, Any] = {"commits": [], "heard": []}
        self.calls = 0
        self.counted: Counter[str] = Counter()

    def on_train_start(self, trainer: Any, module: Any) -> None:
        # The rank this process started as (a regroup renumbers the survivors).
        self.rank = trainer.global_rank
        self.result.update(rank=self.rank, threads=torch.get_num_threads())
        if self.count == "collectives":
            COUNTER.install()
        heard = self.result["heard"]

        class Heard(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                heard.append((time.time(), record.getMessage()))

        logging.getLogger("accord.trainer.rank_loss").addHandler(Heard())

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == 1:
            self.start = (time.perf_counter(), time.process_time(), trainer.global_step)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.kill is not None and (self.rank, step) == self.kill[:2]:
            self._write({"rank": self.rank, "killed": time.time()})
            os.kill(os.getpid(), self.kill[2])
        if self.count == "calls" and step in (COUNT_FROM, COUNT_FROM + COUNTED):
            sys.setprofile(self._profile if step == COUNT_FROM else None)
        if self.count == "collectives" and step == COUNT_FROM:
            self.counted = Counter(COUNTER.counts)
        if self.count == "collectives" and step == COUNT_FROM + COUNTED:
            self.counted = Counter(COUNTER.counts) - self.counted

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.result["commits"].append((time.time(), trainer.global_step))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        sys.setprofile(None)
        if hasattr(self, "start"):
            steps = trainer.global_step - self.start[2]
            self.result["step_ms"] = (time.perf_counter() - self.start[0]) / steps * 1e3
            self.result["step_cpu_ms"] = (time.process_time() - self.start[1]) / steps * 1e3
        self.result["calls_per_step"] = self.calls / COUNTED
        self.result["collectives_per_step"] = {k: v / COUNTED for k, v in self.counted.items()}
        self._write(self.result)

    def _write(self, result: dict[str, Any]) -> None:
        (self.folder / f"rank{self.rank}.json").write_text(json.dumps(result))


def fit(ranks: int, epochs: int, mode: str, **probe: Any) -> list[dict[str, Any]]:
    """One ddp_fork fit; what each rank wrote (a killed rank: when it was killed)."""
    with tempfile.TemporaryDirectory() as scratch:
        trainer = accord.Trainer(
            strategy="ddp_fork",
            accelerator="cpu",
            devices=ranks,
            max_epochs=epochs,
            on_rank_loss=mode,
            callbacks=[Probe(Path(scratch), **probe)],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        loader = DataLoader(make_dataset(), batch_size=BATCH_SIZE, shuffle=True)
        trainer.fit(AccordMlp(), loader)
        return [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("rank*.json"))]


def threads_note(ranks: int, used: set[int]) -> str:
    """How the ranks' threads were set, for the report."""
    env = os.environ.get("OMP_NUM_THREADS")
    source = f"OMP_NUM_THREADS={env}" if env else "OMP_NUM_THREADS unset: the cores / ranks"
    return (
        f"{ranks} ranks forked by ddp_fork on {os.cpu_count()} cores, each "
        f"torch.set_num_threads({'/'.join(map(str, sorted(used)))}) by the launcher ({source})"
    )


def per_step_cost(rounds: int, epochs: int) -> list[dict[str, Any]]:
    """Part 1: ``continue`` vs ``fail`` without a failure: time, calls and collectives."""
    modes = ("fail", "continue")
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    used: set[int] = set()

    def timed(mode: str) -> float:
        ranks = fit(2, epochs, mode)
        cpu[mode].append(max(r["step_cpu_ms"] for r in ranks))
        used.update(r["threads"] for r in ranks)
        return max(r["step_ms"] for r in ranks)

    samples = interleave({mode: lambda mode=mode: timed(mode) for mode in modes}, rounds)
    calls = {mode: [r["calls_per_step"] for r in fit(2, 1, mode, count="calls")] for mode in modes}
    collectives = {mode: fit(2, 1, mode, count="collectives")[0] for mode in modes}

    def per_op(mode: str) -> str:
        ops = collectives[mode]["collectives_per_step"]
        each = ", ".join(f"{op} {n:.2f}" for op, n in sorted(ops.items()))
        return f"{mode} {sum(ops.values()):.2f}" + (f" ({each})" if each else "")

    steps = SAMPLES // (2 * BATCH_SIZE)
    threads = threads_note(2, used)
    return [
        section(
            "rank_loss_step",
            "ms per step, ddp x2, on_rank_loss='continue' vs 'fail', no failure",
            "ms/step",
            samples,
            threads=threads,
            ratios=[("continue", "fail", None)],
            notes=[
                f"{SAMPLES} samples, batch {BATCH_SIZE}, {steps} steps per epoch per rank, "
                f"{epochs} epochs per fit (epoch 0 untimed), the slower rank's time; one "
                f"ddp_fork fit per sample, {rounds} interleaved rounds after a warm-up round",
                "CPU ms per step (process time, the slower rank), median: "
                + ", ".join(f"{m} {statistics.median(v):.3g}" for m, v in cpu.items()),
            ],
        ),
        section(
            "rank_loss_calls",
            "Python calls per training step, ddp x2, on_rank_loss='continue' vs 'fail'",
            "calls/step",
            calls,
            threads=threads,
            notes=[
                f"counted with sys.setprofile on each rank's training thread over {COUNTED} "
                f"steps from step {COUNT_FROM} (not timed); a sample per rank",
                "torch.distributed collectives per step (outermost calls, rank 0, the same "
                f"steps): {per_op('fail')}; {per_op('continue')}; DDP's gradient "
                "all-reduce runs in its C++ reducer and is not among them",
            ],
            extra={
                "collectives_per_step": {
                    m: c["collectives_per_step"] for m, c in collectives.items()
                }
            },
        ),
    ]


def recovery(
    ranks: int, how: signal.Signals, reps: int, timeout: int | None = None
) -> dict[str, Any]:
    """Part 2: seconds from the loss of rank `VICTIM` to the survivors' next committed step."""
    if timeout is not None:
        os.environ["ACCORD_COLLECTIVE_TIMEOUT"] = str(timeout)
    next_commit: list[float] = []  # to the slower survivor's commit
    first: list[float] = []  # to the first survivor's commit
    heard: list[float] = []  # to the survivors' announcement
    step_ms: list[float] = []
    said, used = "", set()
    try:
        for _ in range(reps):
            written = fit(ranks, 1, "continue", kill=(VICTIM, KILL_AT, how))
            killed = next(r["killed"] for r in written if "killed" in r)
            survivors = [r for r in written if "killed" not in r]
            assert len(survivors) == ranks - 1, written
            used.update(r["threads"] for r in survivors)
            after = [next(t for t, s in r["commits"] if s > KILL_AT) for r in survivors]
            next_commit.append(max(after) - killed)
            first.append(min(after) - killed)
            if messages := [m for r in survivors for m in r["heard"]]:
                heard.append(min(messages)[0] - killed)
                said = min(messages)[1]
            before = [t for t, s in survivors[0]["commits"] if s <= KILL_AT]
            step_ms.append((before[-1] - before[0]) / (len(before) - 1) * 1e3)
    finally:
        os.environ.pop("ACCORD_COLLECTIVE_TIMEOUT", None)
    name, med = how.name, statistics.median
    notes = [
        f"rank {VICTIM} of {ranks} sends itself {name} in on_train_batch_start of step "
        f"{KILL_AT} (time.time() written just before); to the slower survivor's "
        f"on_train_batch_end of step {KILL_AT + 1}; {reps} fits",
        f"to the first survivor's commit, median {med(first):.2f} s; to the survivors' "
        f"announcement (rank 0's log record), median {med(heard):.2f} s"
        if heard
        else "the survivors announced nothing",
        f"a step before the loss took {med(step_ms):.1f} ms (median)",
        f"the survivors said: {said}",
    ]
    title = f"Seconds from a {name} to the next committed step, ddp x{ranks}, continue"
    if timeout is not None:
        title += f", ACCORD_COLLECTIVE_TIMEOUT={timeout}"
        notes.append(
            f"includes the {timeout} s collective timeout (the survivors' wait on the frozen "
            "rank fails only then) and the regroup's wait for the frozen rank's heartbeat to "
            f"stand still ({STALE_SECONDS:g} s)"
        )
    return section(
        f"rank_loss_{name.lower()}",
        title,
        "s",
        {"continue": next_commit},
        threads=threads_note(ranks, used),
        notes=notes,
    )


def main() -> None:
    parse = parser(__doc__.splitlines()[0])
    parse.add_argument("--quick", action="store_true", help="3 rounds, fewer fits (about 1.5 min)")
    args = parse.parse_args()
    set_threads(1)  # this process only forks the ranks and serves the store
    if args.smoke:
        rounds, epochs, reps, ranks = args.rounds or 1, 2, 1, 3
    elif args.quick:
        rounds, epochs, reps, ranks = args.rounds or 3, EPOCHS, 2, 4
    else:
        rounds, epochs, reps, ranks = args.rounds or 7, EPOCHS, 5, 4
    sections = per_step_cost(rounds, epochs)
    sections.append(recovery(ranks, signal.SIGKILL, reps))
    if not args.smoke:
        sections.append(recovery(ranks, signal.SIGSTOP, max(reps - 2, 1), timeout=5))
    emit("bench_rank_loss.py", sections, args.json)


if __name__ == "__main__":
    main()
