"""DDP regression tests: real fits over gloo, started by every launcher accord supports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.collectives import ReduceOpLike, TorchCollective
from accord.environments.local import find_free_port
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import CountingCollective, LinearModel, flat_weights, loader
from tests.helpers.processes import run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "fit.py")


def _single_device_weights() -> torch.Tensor:
    """The same global batch (2 ranks x 16) on one device: batch 32."""
    model = LinearModel()
    trainer = accord.Trainer(
        strategy="single_device",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit(model, loader(batch_size=32))
    return flat_weights(model)


def _check_ranks(out: Path, world_size: int) -> None:
    results = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    for result in results:
        assert result["world_size"] == world_size
        assert result["global_step"] == 2 * 256 // (16 * world_size)
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
        assert result["losses"][-1] < result["losses"][0] / 4
        assert result["test_loss"] == results[0]["test_loss"]
    if world_size == 2:
        torch.testing.assert_close(
            results[0]["weights"], _single_device_weights(), rtol=1e-5, atol=1e-6
        )


def test_popen_relaunches_the_script(tmp_path: Path) -> None:
    run_python([SCRIPT, str(tmp_path), "ddp", "2", "1"])
    _check_ranks(tmp_path, 2)


def test_torchrun_two_processes(tmp_path: Path) -> None:
    run_python(
        [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(find_free_port()),
            SCRIPT,
            str(tmp_path),
            "ddp",
            "2",
            "1",
        ]
    )
    _check_ranks(tmp_path, 2)


def test_torchrun_two_nodes_on_loopback(tmp_path: Path) -> None:
    import subprocess

    port = str(find_free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                SCRIPT,
                str(tmp_path),
                "ddp",
                "1",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    _check_ranks(tmp_path, 2)


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_spawn_and_fork_return_trained_weights(strategy: str) -> None:
    model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    # The launching process holds rank zero's weights, equal to the one-device run.
    torch.testing.assert_close(flat_weights(model), _single_device_weights(), rtol=1e-5, atol=1e-6)
    assert trainer.global_step == 16
    assert float(trainer.callback_metrics["train_loss_epoch"]) < 1.0


def test_a_failing_rank_stops_the_popen_job(tmp_path: Path) -> None:
    result = run_python([SCRIPT, str(tmp_path), "ddp", "2", "1", "1"], check=False, timeout=120)
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr
    assert "local rank 1" in result.stderr


class CountingDDP(DDPStrategy):
    """A subclass that changes communication through the one hook for it."""

    def default_collective(self) -> CountingCollective:
        return CountingCollective()


def _fit_with(rank: int, world_size: int, how: str) -> dict[str, Any]:
    if how == "subclass":
        strategy: DDPStrategy = CountingDDP()
    elif how == "injected":
        strategy = DDPStrategy(collective=CountingCollective())
    else:
        strategy = DDPStrategy(collective=CountingCollective(), gradient_sync="collective")
    model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    collective = strategy.collective
    assert isinstance(collective, CountingCollective)
    return {"calls": collective.calls, "weights": flat_weights(model), "steps": trainer.global_step}


@pytest.mark.parametrize("how", ["subclass", "injected", "gradients"])
def test_custom_collective_drives_the_fit(how: str) -> None:
    results = run_distributed(_fit_with, 2, how, timeout=120)
    steps = results[0]["steps"]
    for result in results:
        # One all_gather per step syncs the logged step metric; one more per epoch end.
        assert result["calls"].get("all_gather", 0) == steps + 2
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
    if how == "gradients":
        # Every gradient bucket went through the collective (one bucket per step here).
        assert results[0]["calls"]["all_reduce"] >= steps
    torch.testing.assert_close(
        results[0]["weights"], _single_device_weights(), rtol=1e-5, atol=1e-6
    )


class Recording:
    """A user's mixin: counts the all_reduces it sees, then passes them on. It was written
    without ``async_op``, which DDP's gradient hook passes."""

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is tensor and op == "mean":  # how DDP's hook hands over a gradient bucket
            self.buckets = getattr(self, "buckets", 0) + 1
        return super().all_reduce(tensor, op, out=out)  # type: ignore[misc, no-any-return]


class RecordingTorch(Recording, TorchCollective):  # type: ignore[misc]
    """The mixin composed with the collective, as a user would."""


class RecordingDDP(DDPStrategy):
    def default_collective(self) -> RecordingTorch:
        return RecordingTorch("gloo")


class AsksForEngineTraffic(RecordingTorch):
    """A collective that wants every byte an engine sends, as a debug check does."""

    @property
    def wants_engine_traffic(self) -> bool:
        return True


def _fit_with_mixin(rank: int, world_size: int, how: str) -> dict[str, Any]:
    if how == "collective_sync":
        strategy: DDPStrategy = RecordingDDP(gradient_sync="collective")
    else:  # native sync, but the collective asks for the engine's traffic
        strategy = DDPStrategy(collective=AsksForEngineTraffic("gloo"))
    model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    collective = strategy.collective
    assert isinstance(collective, RecordingTorch)
    return {
        "buckets": getattr(collective, "buckets", 0),
        "weights": flat_weights(model),
        "steps": trainer.global_step,
    }


@pytest.mark.parametrize("how", ["collective_sync", "collective_asks"])
def test_an_override_from_a_mixin_sees_every_gradient_bucket(how: str) -> None:
    results = run_distributed(_fit_with_mixin, 2, how, timeout=120)
    steps = results[0]["steps"]
    for result in results:
        # One gradient bucket per step here, each through the mixin's all_reduce.
        assert result["buckets"] == steps > 0
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
    torch.testing.assert_close(
        results[0]["weights"], _single_device_weights(), rtol=1e-5, atol=1e-6
    )


class PlateauOnRankOne(LinearModel):
    """Rank 1's validation metric stops improving after epoch 1; rank 0's keeps improving."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        value = 1.0 / (epoch + 1) if self.global_rank == 0 or epoch < 1 else 0.5
        self.log("score", torch.tensor(value))  # not synced: each rank judges its own


def _early_stop(rank: int, world_size: int) -> int:
    model = PlateauOnRankOne()
    trainer = accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_train_batches=2,
        callbacks=[accord.callbacks.EarlyStopping("score", patience=2)],
    )
    trainer.fit(model, loader(batch_size=16), loader(batch_size=16))
    return trainer.current_epoch


def test_early_stopping_on_one_rank_stops_every_rank_together() -> None:
    epochs = run_distributed(_early_stop, 2, timeout=120)
    # Rank 1 logs 1.0, 0.5, 0.5, 0.5, ...: no improvement at epochs 2 and 3, so with
    # patience=2 it asks to stop after epoch 3; rank 0 keeps improving but stops with it.
    assert epochs == [4, 4]


def _strategy_helpers(rank: int, world_size: int) -> dict[str, Any]:
    strategy = DDPStrategy(process_group_backend="gloo")
    accord.Trainer(strategy=strategy, devices=world_size, accelerator="cpu", logger=False)
    strategy.setup_environment()
    try:
        return {
            "gather": strategy.all_gather(torch.arange(rank + 1)).tolist(),
            "mean": float(strategy.reduce(torch.tensor(float(rank)))),
            "object": strategy.broadcast({"from": rank}, src=1),
            "any": strategy.reduce_boolean_decision(rank == 2, all=False),
            "all": strategy.reduce_boolean_decision(rank == 2, all=True),
            "every": strategy.reduce_boolean_decision(True, all=True),
        }
    finally:
        strategy.teardown()


def test_strategy_helpers_across_three_ranks() -> None:
    for result in run_distributed(_strategy_helpers, 3, timeout=60):
        assert result["gather"] == [0, 0, 1, 0, 1, 2]
        assert result["mean"] == 1.0
        assert result["object"] == {"from": 1}
        assert (result["any"], result["all"], result["every"]) == (True, False, True)


class _SaveMidEpoch(accord.callbacks.Callback):
    """Writes a checkpoint after batch 3 of epoch 1 (every rank takes part)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 1 and batch_idx == 3:
            trainer.save_checkpoint(self.path)


def _resume_mid_epoch(rank: int, world_size: int, root: str) -> list[torch.Tensor]:
    def fit(model: LinearModel, **kwargs: Any) -> None:
        trainer = accord.Trainer(
            strategy="ddp",
            devices=2,
            accelerator="cpu",
            max_epochs=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            **kwargs,
        )
        trainer.fit(model, loader(batch_size=16, shuffle=True), ckpt_path=ckpt)

    path = str(Path(root) / "mid.ckpt")
    ckpt = None
    straight = LinearModel()
    fit(straight)
    fit(LinearModel(), callbacks=[_SaveMidEpoch(path)])
    ckpt = path
    resumed = LinearModel()
    fit(resumed)
    return [flat_weights(straight), flat_weights(resumed)]


def test_resume_from_the_middle_of_an_epoch(tmp_path: Path) -> None:
    for straight, resumed in run_distributed(_resume_mid_epoch, 2, str(tmp_path), timeout=120):
        torch.testing.assert_close(resumed, straight)
