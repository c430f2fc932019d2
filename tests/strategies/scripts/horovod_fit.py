"""Fits with ``strategy="horovod"``, run under horovodrun by ``test_horovod.py``.

Usage: horovodrun --gloo -np N -H localhost:N python horovod_fit.py OUT_DIR SCENARIO
(or plain ``python horovod_fit.py OUT_DIR fit`` for a Horovod group of one).
Each rank writes ``OUT_DIR/rank<global rank>.pt`` with what the scenario measured.

Scenarios: ``fit`` (plain, accumulated and clipped fits), ``resume`` (a checkpoint written
mid-fit and resumed), ``agree`` (EarlyStopping and the strategy's helpers across ranks),
``uneven`` (ranks with different numbers of batches, which Horovod's join absorbs),
``dtypes`` (the collective on dtypes Horovod's own ops lack, beyond the conformance suite),
``precision`` (a float32 dataset trained with ``"bf16-true"``, ``"16-true"`` and
``"bf16-mixed"``), and ``custom`` (a `HorovodCollective` subclass that counts the Horovod
operations the strategy sends through it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Run by path (by a test, torchrun, horovodrun or srun): the repository root goes on the
# path, so the test helpers import as the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import accord
from accord.callbacks import Callback, EarlyStopping
from tests.helpers.models import LinearModel, flat_weights, loader, regression_data

RANK = int(os.environ.get("HOROVOD_RANK", 0))


def _trainer(**kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "strategy": "horovod",
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        **kwargs,
    }
    return accord.Trainer(**settings)


class Probe(Callback):
    """Records, while the run is up, what the strategy reports about Horovod."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: accord.Trainer, module: accord.Module) -> None:
        import horovod.torch as hvd

        strategy = trainer.strategy
        self.seen = {
            "hvd": (hvd.rank(), hvd.size(), hvd.local_rank()),
            "strategy": (strategy.global_rank, strategy.world_size, strategy.local_rank),
            "sampler": strategy.distributed_sampler_kwargs,
            "collective": type(strategy.base_collective).__name__,
            "optimizer": type(trainer.optimizers[0]).__module__,
            "passes": getattr(trainer.optimizers[0], "backward_passes_per_step", None),
        }


def _summary(trainer: accord.Trainer, model: LinearModel, probe: Probe) -> dict[str, Any]:
    return {
        "weights": flat_weights(model),
        "global_step": trainer.global_step,
        "losses": list(model.losses),
        "train_loss": float(trainer.callback_metrics["train_loss_epoch"]),
        **probe.seen,
    }


def scenario_fit(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, kwargs in (
        ("plain", {}),
        ("accumulate", {"accumulate_grad_batches": 2}),
        ("clip", {"gradient_clip_val": 0.5}),
    ):
        model, probe = LinearModel(), Probe()
        trainer = _trainer(max_epochs=2, callbacks=[probe], **kwargs)
        trainer.fit(model, loader(batch_size=16))
        results[name] = _summary(trainer, model, probe)
    return results


class MomentumModel(LinearModel):
    """SGD with momentum, so a checkpoint carries optimizer state."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SaveAfterFirstEpoch(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: accord.Trainer, module: accord.Module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def scenario_resume(out: Path) -> dict[str, Any]:
    straight = MomentumModel()
    _trainer(max_epochs=3).fit(straight, loader(batch_size=16))
    checkpoint = out / "epoch0.ckpt"
    first = MomentumModel()
    _trainer(max_epochs=1, callbacks=[SaveAfterFirstEpoch(checkpoint)]).fit(
        first, loader(batch_size=16)
    )
    resumed = MomentumModel()
    trainer = _trainer(max_epochs=3)
    trainer.fit(resumed, loader(batch_size=16), ckpt_path=checkpoint)
    return {
        "straight": flat_weights(straight),
        "after_first_epoch": flat_weights(first),
        "resumed": flat_weights(resumed),
        "resumed_step": trainer.global_step,
        "checkpoint_exists": checkpoint.is_file(),
    }


class PlateauOnRankOne(LinearModel):
    """Rank 1's validation score stops improving after epoch 1; rank 0's keeps improving."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        value = 1.0 / (epoch + 1) if self.global_rank == 0 or epoch < 1 else 0.5
        self.log("score", torch.tensor(value))  # not synced: each rank judges its own


class Helpers(Callback):
    """Calls the strategy's communication helpers once the collective is up."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: accord.Trainer, module: accord.Module) -> None:
        strategy, rank = trainer.strategy, trainer.global_rank
        self.seen = {
            "any": strategy.reduce_boolean_decision(rank == 1, all=False),
            "all": strategy.reduce_boolean_decision(rank == 1, all=True),
            "every": strategy.reduce_boolean_decision(True, all=True),
            "gather": strategy.all_gather(torch.arange(rank + 1)).tolist(),
            "mean": float(strategy.reduce(torch.tensor(float(rank)))),
            "object": strategy.broadcast({"from": rank}, src=trainer.world_size - 1),
        }


def scenario_agree(out: Path) -> dict[str, Any]:
    helpers = Helpers()
    trainer = _trainer(
        max_epochs=20,
        limit_train_batches=2,
        callbacks=[EarlyStopping("score", patience=2), helpers],
    )
    trainer.fit(PlateauOnRankOne(), loader(batch_size=16), loader(batch_size=16))
    return {"stopped_after_epochs": trainer.current_epoch, **helpers.seen}


class EpochLoss(LinearModel):
    """Logs its loss only as an epoch mean: no collective in the extra batches."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.losses.append(float(loss.detach()))
        return loss


def scenario_uneven(out: Path) -> dict[str, Any]:
    # Rank r trains on 5 - 2r batches of its own (plain lists are not re-sharded).
    data = regression_data(samples=256)
    batches = [
        (data.tensors[0][i : i + 16], data.tensors[1][i : i + 16]) for i in range(0, 256, 16)
    ]
    mine = batches[RANK * 5 : RANK * 5 + 5 - 2 * RANK]
    model = EpochLoss()
    trainer = _trainer(max_epochs=3)
    trainer.fit(model, mine)
    return {
        "weights": flat_weights(model),
        "global_step": trainer.global_step,
        "batches": len(mine),
        "losses": list(model.losses),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
    }


def scenario_dtypes(out: Path) -> dict[str, Any]:
    from accord.engines.horovod.collective import HorovodCollective

    c = HorovodCollective().setup()
    r = c.rank
    u8 = torch.tensor([200, 3], dtype=torch.uint8) + r
    i8 = torch.tensor([-100, 5], dtype=torch.int8) - 50 * r
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16) * (r + 1)
    complex64 = torch.tensor([1 + 2j, 3j]) * (r + 1)
    try:
        return {
            "u8 sum": c.all_reduce(u8, "sum"),
            "u8 max": c.all_reduce(u8, "max"),
            "i8 sum": c.all_reduce(i8, "sum"),
            "bf16 sum": c.all_reduce(bf16, "sum"),
            "bf16 all_gather": c.all_gather(bf16),
            "bf16 all_to_all": c.all_to_all(bf16),
            "complex sum": c.all_reduce(complex64, "sum"),
            "complex broadcast": c.broadcast(complex64, src=1),
            "int32 reduce_scatter": c.reduce_scatter(torch.arange(4, dtype=torch.int32) + r),
        }
    finally:
        c.teardown()


class DtypeRecorder(LinearModel):
    """`LinearModel` that records the dtypes of the batches its steps receive."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_dtypes: set[torch.dtype] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_dtypes.update(t.dtype for t in batch)
        return super().training_step(batch, batch_idx)


def scenario_precision(out: Path) -> dict[str, Any]:
    # bf16-true: Horovod's ops have no bfloat16 kernel; the strategy sends those gradients
    # as float32 (BFloat16AsFloat32).
    results: dict[str, Any] = {}
    for precision in ("bf16-true", "16-true", "bf16-mixed"):
        model = DtypeRecorder()
        trainer = _trainer(
            max_epochs=3, precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.5
        )
        trainer.fit(model, loader(batch_size=16))
        results[precision] = {
            "weights": flat_weights(model),
            "param_dtypes": {p.dtype for p in model.parameters()},
            "batch_dtypes": model.batch_dtypes,
            "global_step": trainer.global_step,
            "losses": list(model.losses),
        }
    return results


def _counting_collective() -> Any:
    from accord.engines.horovod.collective import HorovodCollective

    class CountingHorovodCollective(HorovodCollective):
        """Counts the calls of Horovod's own operations."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def _count(self, name: str) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
            self._count("broadcast_module")
            super().broadcast_module(module, src)

        def broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, src: int = 0) -> None:
            self._count("broadcast_optimizer_state")
            super().broadcast_optimizer_state(optimizer, src)

        def distributed_optimizer(self, *args: Any, **options: Any) -> torch.optim.Optimizer:
            self._count("distributed_optimizer")
            return super().distributed_optimizer(*args, **options)

        def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
            self._count("synchronize")
            super().synchronize(optimizer)

        def join(self, device: torch.device | None = None) -> int:
            self._count("join")
            return super().join(device)

    return CountingHorovodCollective()


def scenario_custom(out: Path) -> dict[str, Any]:
    from accord.engines.horovod.strategy import HorovodStrategy

    results: dict[str, Any] = {}
    # Uneven data (rank r has 5 - 2r batches): joins, then the broadcasts from the rank
    # that stepped most. Even data in debug mode: the calls pass the debug wrapper.
    data = regression_data(samples=256)
    batches = [
        (data.tensors[0][i : i + 16], data.tensors[1][i : i + 16]) for i in range(0, 256, 16)
    ]
    for name, mine, debug in (
        ("uneven", batches[RANK * 5 : RANK * 5 + 5 - 2 * RANK], False),
        ("debug", batches[RANK * 4 : RANK * 4 + 4], True),
    ):
        collective, model = _counting_collective(), EpochLoss()
        trainer = _trainer(
            strategy=HorovodStrategy(collective=collective, debug=debug), max_epochs=2
        )
        trainer.fit(model, mine)
        results[name] = {
            "calls": dict(collective.calls),
            "global_step": trainer.global_step,
            "weights": flat_weights(model),
            "outer": type(trainer.strategy.collective).__name__,
        }
    return results


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "fit": scenario_fit,
    "resume": scenario_resume,
    "agree": scenario_agree,
    "uneven": scenario_uneven,
    "dtypes": scenario_dtypes,
    "precision": scenario_precision,
    "custom": scenario_custom,
}


def main() -> None:
    """Run the scenario named on the command line and save what this rank measured."""
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    result = SCENARIOS[scenario](out)
    torch.save(result, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main()
