"""Seconds from process start to the first training step: ``ddp``, 2 ranks, on CPU.

Each round starts ``python bench_startup.py --child NAME`` fresh, the way a user starts a
script: the framework's own ``ddp`` launcher then re-runs the script for rank 1. Each
rank's first ``training_step`` writes a wall-clock timestamp; the figure is the later of
the two minus the moment just before the process was started. Imports, the launch of
rank 1, the rendezvous, DDP's wrapping and the first batch are all inside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BATCH_SIZE, emit, interleave, parser, peers, section

_STAMPS = "ACCORD_BENCH_STAMPS"
_CLEAN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
# How a process ends when a gloo worker thread takes the GIL while the interpreter shuts
# down (accord lends its tensors to avoid it; Lightning's DDP children meet it now and
# then). The fit is over by then, so the start-up figure stands.
_EXIT_ABORT = "terminate called without an active exception"


def _stamp(rank: int) -> None:
    directory = Path(os.environ[_STAMPS])
    path = directory / f"rank{rank}"
    if not path.exists():
        path.write_text(repr(time.time()))


def child_accord() -> None:
    """A minimal accord ``ddp`` fit; rank 1 is started by accord's launcher."""
    import torch
    from common import loss_fn, make_dataset, make_net, make_optimizer
    from torch.utils.data import DataLoader

    import accord

    class Startup(accord.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 0:
                _stamp(self.trainer.global_rank)
            return loss_fn(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    accord.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    ).fit(Startup(), DataLoader(make_dataset(1024), batch_size=BATCH_SIZE, shuffle=True))


def child_lightning() -> None:
    """The same fit under Lightning; rank 1 is started by Lightning's launcher."""
    import pytorch_lightning as pl
    import torch
    from common import loss_fn, make_dataset, make_net, make_optimizer
    from torch.utils.data import DataLoader

    class Startup(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 0:
                _stamp(self.global_rank)
            return loss_fn(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    ).fit(Startup(), DataLoader(make_dataset(1024), batch_size=BATCH_SIZE, shuffle=True))


def start_once(name: str, log: list[dict[str, Any]]) -> float:
    """Start one fresh fit of ``name``; return seconds to its first training step."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as stamps:
        env[_STAMPS] = stamps
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name]
        started = time.time()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        finished = time.time()
        files = [Path(stamps) / f"rank{rank}" for rank in (0, 1)]
        # accord promises a clean exit: only another framework's abort is let through.
        aborted_at_exit = (
            name != "accord"
            and done.returncode == -signal.SIGABRT
            and _EXIT_ABORT in done.stderr
            and all(f.exists() for f in files)
        )
        if done.returncode != 0 and not aborted_at_exit:
            raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        first = [float(f.read_text()) for f in files]
    log.append(
        {
            "contestant": name,
            "first_step": first,
            "exit": finished - started,
            "aborted_at_exit": aborted_at_exit,
        }
    )
    return max(first) - started


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument("--child", choices=("accord", "lightning"), default=None)
    args = parse.parse_args()
    if args.child == "accord":
        child_accord()
        return
    if args.child == "lightning":
        child_lightning()
        return
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 5)
    taking_part, skipped = peers(smoke, "pytorch_lightning")
    names = ["accord"] + (["lightning"] if taking_part else [])
    log: list[dict[str, Any]] = []
    samples = interleave(
        {name: (lambda name=name: start_once(name, log)) for name in names},
        rounds,
        warmup=0 if smoke else 1,
    )
    exits = {
        name: sorted(entry["exit"] for entry in log if entry["contestant"] == name)
        for name in names
    }
    sec = section(
        "startup",
        "Process start to first training step, ddp, 2 ranks (CPU, gloo)",
        "s",
        samples,
        threads="OMP_NUM_THREADS=1 in the environment; each framework's launcher starts rank 1",
        ratios=[("accord", "lightning", 1.0)],
        skipped={"lightning": skipped["pytorch_lightning"]} if skipped else {},
        notes=[
            f"{rounds} interleaved rounds after a warm-up round (file cache); a 2-step fit",
            "whole process (start to exit), median: "
            + ", ".join(f"{n} {v[len(v) // 2]:.2f} s" for n, v in exits.items()),
            "aborted at exit after the fit (SIGABRT, a gloo thread at interpreter "
            "shutdown), runs: "
            + ", ".join(
                f"{n} {sum(e['aborted_at_exit'] for e in log if e['contestant'] == n)}"
                for n in names
            ),
        ],
        extra={"log": log},
    )
    emit("bench_startup", [sec], args.json)


if __name__ == "__main__":
    main()
