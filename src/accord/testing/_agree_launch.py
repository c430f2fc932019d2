"""How `assert_strategies_agree` runs one strategy's training and reads back its ranks.

The private half of `accord.testing.equivalence`: the recording dataset and callback,
`_launch` (how a strategy's ranks start), `_fit` / `_train` (one training, in this process
or in a rank `run_distributed` started), `_run_external` (under an outside launcher, through
``python -m accord.testing._agree_worker``) and `_read_ranks` (the record files the ranks
leave). Functions run in other processes stay at module level, so they unpickle there.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from accord.callbacks.callback import Callback
from accord.checkpoint.reading import read_checkpoint
from accord.core.parallel import ParallelStrategy
from accord.core.strategy import Strategy
from accord.errors import ConfigurationError, RankFailureError
from accord.module import Module
from accord.seed import seed_everything
from accord.testing.multiprocess import run_distributed

if TYPE_CHECKING:
    from accord.testing.equivalence import StrategySpec

_SINGLE_PROCESS = ("single_device", "dp")


class _IndexedDataset(Dataset[Any]):
    """The user's dataset, noting which indices were read since the last `take`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.read.append(int(index))
        return self.dataset[index]

    def take(self) -> list[int]:
        read, self.read = self.read, []
        return read


class _Recorder(Callback):
    """Records each step's loss and samples on this rank, and saves the final state."""

    def __init__(self, dataset: _IndexedDataset, root: Path, label: str) -> None:
        self.dataset = dataset
        self.root = root
        self.label = label
        self.losses: list[float] = []
        self.samples: list[list[int]] = []

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            raise ConfigurationError(
                "assert_strategies_agree needs training_step to return the loss (a tensor, "
                f"or a dict with a 'loss' key); it returned {type(outputs).__name__}."
            )
        self.losses.append(float(loss.detach().float().mean()))
        self.samples.append(self.dataset.take())

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(_checkpoint(self.root, self.label))
        # Each rank leaves what it saw in a file: ranks a launcher started (spawn, fork,
        # horovodrun) return nothing to the kit.
        record = {"losses": self.losses, "samples": self.samples}
        path = _rank_file(self.root, self.label, trainer.global_rank)
        partial = path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(record))
        partial.replace(path)


def _checkpoint(root: Path, label: str) -> Path:
    return root / f"{label}.ckpt"


def _rank_file(root: Path, label: str, rank: int) -> Path:
    return root / f"{label}.rank{rank}.pkl"


def _label(spec: StrategySpec) -> str:
    if isinstance(spec, str):
        return spec
    return str(getattr(spec, "__name__", type(spec).__name__))


def _build(spec: StrategySpec) -> str | Strategy:
    if isinstance(spec, str):
        return spec
    strategy = spec()
    if not isinstance(strategy, Strategy):
        raise ConfigurationError(
            f"The strategy factory {_label(spec)} returned {type(strategy).__name__}, not an "
            "accord Strategy."
        )
    return strategy


_Launch = Literal["caller", "ranks", "launcher", "external"]


def _launch(spec: StrategySpec, devices: int) -> tuple[_Launch, int, list[str] | None]:
    """How a strategy's ranks start, how many, and the outside launcher's command if needed.

    ``"caller"``: one process, this one. ``"ranks"``: one process per rank, started by
    `run_distributed` (the strategy then finds its ranks already running, as under
    torchrun); also a one-process strategy that `Strategy.needs_own_process`, in one fresh
    process. ``"launcher"``: the strategy's own launcher starts the ranks (spawn, fork,
    ``xmp.spawn``), so the Trainer runs in this process; started from `run_distributed`,
    each rank would launch ranks of its own. ``"external"``: only an outside launcher
    (horovodrun) can start them.
    """
    if isinstance(spec, str) and spec in _SINGLE_PROCESS:
        return "caller", 1, None
    if isinstance(spec, str):
        from accord.strategies.registry import StrategyRegistry

        strategy = StrategyRegistry.get(spec).build()
    else:
        built = _build(spec)
        assert isinstance(built, Strategy)
        strategy = built
    if not isinstance(strategy, ParallelStrategy):
        # A one-process strategy that must not share this process (single_xla) gets its own.
        return ("ranks" if strategy.needs_own_process else "caller"), 1, None
    command = strategy.external_launch_command(devices)
    if command is not None:
        return "external", devices, command
    return ("launcher" if strategy.launches_own_processes else "ranks"), devices, None


def _fit(
    spec: StrategySpec,
    make_module: Callable[[], Module],
    make_data: Callable[[], Any],
    settings: dict[str, Any],
    root: Path,
    world_size: int,
) -> None:
    """One training under ``spec`` on ``world_size`` ranks; every rank leaves its record file."""
    from accord.trainer.trainer import Trainer

    seed_everything(settings["seed"])
    module = make_module()
    dataset = _IndexedDataset(make_data())
    loader = DataLoader(dataset, batch_size=settings["batch_size"] // world_size, shuffle=False)
    label = _label(spec)
    trainer = Trainer(
        strategy=_build(spec),
        accelerator=settings["accelerator"],
        devices=world_size,
        precision=settings["precision"],
        max_steps=settings["steps"],
        callbacks=[_Recorder(dataset, root, label)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        **settings["trainer_kwargs"],
    )
    trainer.fit(module, loader)


def _train(
    rank: int,
    world_size: int,
    spec: StrategySpec,
    make_module: Callable[[], Module],
    make_data: Callable[[], Any],
    settings: dict[str, Any],
    root: Path,
) -> None:
    """One rank's training, in a process `run_distributed` started."""
    _fit(spec, make_module, make_data, settings, root, world_size)


def _run_external(
    command: list[str], ranks: int, args: tuple[Any, ...], root: Path, timeout: float
) -> None:
    """Run `_fit` on ``ranks`` ranks under an outside launcher (``command``, horovodrun).

    The arguments travel pickled in a file, after the caller's ``sys.path`` (so the ranks
    import ``make_module`` and ``make_data`` from where the caller did); each rank runs
    ``python -m accord.testing._agree_worker FILE``.
    """
    spec = args[0]
    payload = root / f"{_label(spec)}.args.pkl"
    with payload.open("wb") as f:
        pickle.dump(list(sys.path), f)
        pickle.dump((*args, ranks), f)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    argv = [*command, sys.executable, "-m", "accord.testing._agree_worker", str(payload)]
    # Its own session, so a job that hangs is stopped with every rank the launcher started.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RankFailureError(
            f"{' '.join(argv)} did not finish within {timeout:.0f} s; it was stopped.\n"
            f"{output[-4000:]}"
        ) from None
    if proc.returncode != 0:
        raise RankFailureError(
            f"{' '.join(argv)} failed with exit code {proc.returncode}:\n{output[-4000:]}"
        )


def _read_ranks(root: Path, label: str, ranks: int) -> list[dict[str, Any]]:
    """Every rank's record file, rank 0's with the final weights of the checkpoint."""
    results = []
    for rank in range(ranks):
        path = _rank_file(root, label, rank)
        if not path.exists():
            raise RankFailureError(
                f"{label}: rank {rank} finished without leaving its record ({path.name}); "
                f"the run trained on fewer than {ranks} ranks."
            )
        results.append(pickle.loads(path.read_bytes()))
    state = read_checkpoint(_checkpoint(root, label))["state_dict"]
    results[0]["weights"] = {k: v.detach().cpu().clone() for k, v in state.items()}
    return results


def run_strategy(
    spec: StrategySpec,
    make_module: Callable[[], Module],
    make_data: Callable[[], Any],
    settings: dict[str, Any],
    root: Path,
    devices: int,
    timeout: float,
) -> int:
    """Train ``spec`` (`_fit`'s arguments) on its ranks, started as `_launch` says; how many
    ranks it had."""
    launch, ranks, command = _launch(spec, devices)
    args = (spec, make_module, make_data, settings, root)
    if launch in ("caller", "launcher"):
        _fit(*args, ranks)
    elif launch == "ranks":
        run_distributed(_train, ranks, *args, timeout=timeout)
    else:
        assert command is not None
        _run_external(command, ranks, args, root, timeout)
    return ranks
