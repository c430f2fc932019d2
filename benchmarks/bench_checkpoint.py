"""Checkpoint save and load: accord's against the direct torch / DeepSpeed calls, 2 ranks.

For each of ``ddp``, ``fsdp`` and ``deepspeed_stage_2`` two real rank processes on gloo fit
a ~50M-parameter model (4 square ``Linear`` layers, Adam, so the optimizer state is twice
the weights) for two steps; then, inside the fit (``on_train_end``), they take turns
saving and loading its checkpoint:

* **accord save**: ``trainer.save_checkpoint(path)``, the call a user (or
  ``ModelCheckpoint``) makes: the full training state through the strategy, written
  atomically (staging name, fsync, rename).
* **accord load**: what ``trainer.fit(ckpt_path=path)`` does before its first step
  (`accord.trainer.training_checkpoints.restore`): read the checkpoint with ``weights_only`` and
  load model, optimizer, schedulers, callbacks and the loop position.
* **direct**: the call a user of plain PyTorch or DeepSpeed would make for the same state.
  ``ddp``: rank 0 ``torch.save({"model", "optimizer"})`` + barrier; load
  ``torch.load(weights_only=True)`` + ``load_state_dict`` on every rank. ``fsdp``:
  ``torch.distributed.checkpoint.save/load`` of ``get_state_dict`` +
  ``set_state_dict``. ``deepspeed_stage_2``: the engine's own ``save_checkpoint`` /
  ``load_checkpoint``.
* **direct + fsync** (``ddp`` and ``deepspeed_stage_2`` saves): the same, with every file
  written flushed to disk (``os.fsync``) as accord does. The goal compares accord with this
  row: durability is part of the job; the plain row shows what it costs. torch's DCP
  already fsyncs each file it writes (``FileSystemWriter(sync_files=True)``), so ``fsdp``'s
  direct save is durable as it is.

A sample is one save (or load) from a barrier to a barrier after it: the slower rank's time.
Every save goes to a fresh path that is deleted after it is timed; each load contestant
reads a checkpoint its own save wrote, in the same temporary folder (same filesystem).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from common import TORCHRUN_ENV, emit, interleave, now, parser, section, set_threads, unavailable
from torch import nn

import accord

STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2")
WIDTH = 3584
"""Square Linear layers of 3584 features: 4 of them hold 51.4M parameters."""
LAYERS = 4
SMOKE_WIDTH = 64
BATCH = 8
GOAL = 1.10


class BigModel(accord.Module):
    """``LAYERS`` square Linear layers trained with Adam; benchmarks its checkpoint at the end."""

    def __init__(self, width: int, bench: Callable[[accord.Trainer], Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))
        self._bench = bench
        self.result: Any = None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def on_train_end(self) -> None:
        assert self.trainer is not None
        self.result = self._bench(self.trainer)


def _fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the directories to disk (the direct + fsync side)."""
    targets = [path] if path.is_file() else []
    for root, _, files in os.walk(path):
        targets += [Path(root) / name for name in files] + [Path(root)]
    for target in [*targets, path.parent]:
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Contestants:
    """The save and load calls of one strategy, accord's and the direct ones."""

    def __init__(self, trainer: accord.Trainer, strategy: str, root: Path) -> None:
        self.trainer = trainer
        self.strategy = strategy
        self.root = root
        self.count = 0
        wrapped = trainer.model_wrapper
        assert wrapped is not None
        self.model = trainer.strategy.unwrap(wrapped)
        self.optimizer = trainer.optimizers[0]

    # -------------------------------------------------------------- direct calls
    def direct_save(self, path: Path, fsync: bool) -> None:
        """The plain library call that writes the model and optimizer state to ``path``."""
        if self.strategy == "ddp":
            if dist.get_rank() == 0:
                state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
                with path.open("wb") as handle:
                    torch.save(state, handle)
                    if fsync:
                        handle.flush()
                        os.fsync(handle.fileno())
            dist.barrier()
        elif self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        else:
            engine = self._engine()
            engine.save_checkpoint(str(path))
            if fsync:
                _fsync_tree(path)
            dist.barrier()

    def direct_load(self, path: Path) -> None:
        """The plain library call that reads ``path`` back into the model and optimizer."""
        if self.strategy == "ddp":
            state = torch.load(path, map_location="cpu", weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        elif self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        else:
            load_path, _ = self._engine().load_checkpoint(str(path))
            assert load_path is not None

    def _engine(self) -> Any:
        return cast(Any, self.trainer.strategy).engine

    # -------------------------------------------------------------- accord
    def accord_save(self, path: Path) -> None:
        """``trainer.save_checkpoint``: the full training state, atomically."""
        self.trainer.save_checkpoint(path)

    def accord_load(self, path: Path) -> None:
        """What ``fit(ckpt_path=path)`` runs to restore the training state."""
        from accord.trainer.training_checkpoints import restore

        restore(self.trainer, self.trainer._state, path, "fit")

    # -------------------------------------------------------------- timing
    def fresh_path(self, name: str) -> Path:
        """A new path in the shared folder (every rank gets the same one)."""
        self.count += 1
        return self.root / f"{name}-{self.count}.ckpt"

    def timed(self, call: Callable[[], None]) -> tuple[float, float]:
        """(wall seconds barrier to barrier, this rank's CPU seconds) of ``call``."""
        dist.barrier()
        wall, cpu = now()
        call()
        dist.barrier()
        wall_end, cpu_end = now()
        return wall_end - wall, cpu_end - cpu


SAVES: dict[str, Callable[[Contestants, Path], None]] = {
    "direct": lambda c, p: c.direct_save(p, fsync=False),
    "direct + fsync": lambda c, p: c.direct_save(p, fsync=True),
    "accord": lambda c, p: c.accord_save(p),
}
LOADS: dict[str, Callable[[Contestants, Path], None]] = {
    "direct": lambda c, p: c.direct_load(p),
    "accord": lambda c, p: c.accord_load(p),
}


def save_names(strategy: str) -> list[str]:
    """The save contestants of ``strategy`` (DCP's direct save already fsyncs)."""
    return ["direct", "accord"] if strategy == "fsdp" else list(SAVES)


def run_rounds(trainer: accord.Trainer, strategy: str, root: str, rounds: int) -> dict[str, Any]:
    """Interleave the saves, then the loads; return per-round wall and CPU seconds."""
    bench = Contestants(trainer, strategy, Path(root))
    cpu: dict[str, list[float]] = {}
    names = save_names(strategy)

    def save(name: str) -> Callable[[], float]:
        def run() -> float:
            path = bench.fresh_path(name.replace(" + ", "_"))
            wall, used = bench.timed(lambda: SAVES[name](bench, path))
            cpu.setdefault(f"save {name}", []).append(used)
            dist.barrier()
            if dist.get_rank() == 0:
                _remove(path)
            dist.barrier()
            return wall

        return run

    saves = interleave({name: save(name) for name in names}, rounds)
    # What each load reads: a checkpoint its own side saved (the direct one flushed too).
    sources = {name: bench.fresh_path(f"source-{name}") for name in LOADS}
    bench.accord_save(sources["accord"])
    bench.direct_save(sources["direct"], fsync=True)

    def load(name: str) -> Callable[[], float]:
        def run() -> float:
            wall, used = bench.timed(lambda: LOADS[name](bench, sources[name]))
            cpu.setdefault(f"load {name}", []).append(used)
            return wall

        return run

    loads = interleave({name: load(name) for name in LOADS}, rounds)
    skip = len(next(iter(cpu.values()))) - rounds
    return {
        "save": saves,
        "load": loads,
        "cpu": {name: values[skip:] for name, values in cpu.items()},
    }


def _rank_worker(
    rank: int, world_size: int, strategy: str, root: str, rounds: int, width: int
) -> dict[str, Any]:
    set_threads(1)
    module = BigModel(width, lambda trainer: run_rounds(trainer, strategy, root, rounds))
    generator = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(
        torch.randn(2 * BATCH, width, generator=generator),
        torch.randn(2 * BATCH, width, generator=generator),
    )
    trainer = accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    result: dict[str, Any] = dict(module.result)
    result["parameters"] = LAYERS * (width * width + width)
    return result


def measure(strategy: str, rounds: int, width: int) -> dict[str, Any]:
    """Run the rounds for ``strategy`` in two rank processes; the slower rank's walls."""
    from accord.testing import run_distributed

    with tempfile.TemporaryDirectory(prefix="accord-bench-ckpt-", dir=_scratch()) as root:
        per_rank = run_distributed(
            _rank_worker, 2, strategy, root, rounds, width, timeout=1800, env=TORCHRUN_ENV
        )
    out: dict[str, Any] = {"parameters": per_rank[0]["parameters"]}
    for kind in ("save", "load"):
        out[kind] = {
            name: [max(a, b) for a, b in zip(per_rank[0][kind][name], values, strict=True)]
            for name, values in per_rank[1][kind].items()
        }
    # CPU seconds of both ranks added.
    out["cpu"] = {
        name: [a + b for a, b in zip(values, per_rank[1]["cpu"][name], strict=True)]
        for name, values in per_rank[0]["cpu"].items()
    }
    return out


def _scratch() -> str | None:
    """Where the checkpoints go: ``$ACCORD_BENCH_TMP``, else the system's temporary folder.

    Point it at the disk checkpoints are written to in practice (not a tmpfs).
    """
    return os.environ.get("ACCORD_BENCH_TMP") or None


def main() -> None:
    parse = parser(__doc__)
    parse.add_argument(
        "--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), metavar="NAME"
    )
    args = parse.parse_args()
    smoke = args.smoke
    rounds = args.rounds or (1 if smoke else 7)
    width = SMOKE_WIDTH if smoke else WIDTH
    sections = []
    for strategy in args.strategies:
        reason = unavailable("deepspeed") if strategy.startswith("deepspeed") else None
        result: dict[str, Any] | None = None if reason else measure(strategy, rounds, width)
        for kind in ("save", "load"):
            samples = result[kind] if result else {}
            cpu = result["cpu"] if result else {}
            durable = "direct + fsync" if kind == "save" and "direct + fsync" in samples else None
            ratios: list[tuple[str, str, float | None]] = [("accord", durable or "direct", GOAL)]
            if durable:
                ratios.append(("accord", "direct", None))
            notes = []
            if result:
                megabytes = result["parameters"] * 4 * 3 / 1e6
                notes.append(
                    f"{result['parameters'] / 1e6:.1f}M parameters + Adam state "
                    f"(~{megabytes:.0f} MB of tensors), {rounds} interleaved rounds after a "
                    "warm-up round; the slower rank's time, barrier to barrier"
                )
                notes.append(
                    "CPU seconds (both ranks added), median: "
                    + ", ".join(
                        f"{name} {statistics.median(cpu[f'{kind} {name}']):.3g}" for name in samples
                    )
                )
            notes.append(_what(strategy, kind))
            sections.append(
                section(
                    f"checkpoint_{kind}_{strategy}",
                    f"Checkpoint {kind}, {strategy}, 2 ranks, gloo",
                    "s",
                    samples,
                    threads="2 processes x torch.set_num_threads(1), OMP_NUM_THREADS=1",
                    ratios=ratios,
                    skipped={strategy: reason} if reason else None,
                    notes=notes,
                    extra={"cpu_s": {name: cpu[f"{kind} {name}"] for name in samples}},
                )
            )
    emit("bench_checkpoint", sections, args.json)


def _what(strategy: str, kind: str) -> str:
    """What the contestants of one table call."""
    if kind == "save":
        direct = {
            "ddp": "rank 0 torch.save({model, optimizer} state dicts) + barrier",
            "fsdp": "dcp.save(get_state_dict(model, optimizer)) (DCP fsyncs each file)",
            "deepspeed_stage_2": "engine.save_checkpoint(dir)",
        }[strategy]
        return f"accord = trainer.save_checkpoint(path); direct = {direct}"
    direct = {
        "ddp": "torch.load(weights_only=True) + model/optimizer load_state_dict on each rank",
        "fsdp": "get_state_dict + dcp.load + set_state_dict",
        "deepspeed_stage_2": "engine.load_checkpoint(dir)",
    }[strategy]
    return f"accord = what fit(ckpt_path=path) restores (training_checkpoints.restore); direct = {direct}"


if __name__ == "__main__":
    main()
