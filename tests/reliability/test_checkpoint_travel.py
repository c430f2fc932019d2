"""Checkpoints travel between strategies: what a sharding strategy wrote resumes elsewhere.

Real runs over gloo: a fit of 2 epochs with Adam and an epoch LR scheduler is saved under
FSDP x2 (sharded) and under DeepSpeed ZeRO-2 x2, then resumed for 2 more epochs under DDP x2
and on one device, and compared with a run that was never interrupted. The global batch is
the same everywhere (2 ranks x 16, or 32 on one device), so the runs take the same steps.
The DeepSpeed engine's reader merges the ZeRO-2 partitions of the Adam moments. Also: FSDP
resumes plain SGD (an optimizer without state), and the errors for a directory where a file
is expected, a model that does not match, and a newer checkpoint format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import accord
from accord.checkpoint import (
    CHECKPOINT_FORMAT_VERSION,
    checkpoint_format,
    load_checkpoint_file,
    read_checkpoint,
)
from accord.errors import CheckpointError
from accord.strategies import FSDPStrategy
from accord.testing import run_distributed
from tests.helpers.models import loader

# DDP and FSDP run the same float32 arithmetic up to the order of a few sums (~1e-9 apart
# here); a lost Adam moment or a scheduler that restarted moves the weights by 1e-3 or more.
RTOL, ATOL = 1e-5, 1e-5


class AdamMLP(accord.Module):
    """Two linear layers trained with Adam, whose LR halves after every epoch."""

    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 1))
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


def _fit(
    strategy: accord.strategies.Strategy | str,
    epochs: int,
    *,
    devices: int = 2,
    save_to: Path | None = None,
    ckpt_path: Path | None = None,
    optimizer: str = "adam",
) -> dict[str, torch.Tensor]:
    """Fit ``epochs`` epochs of 4 global batches of 32; the weights afterwards (none when
    FSDP sharded them: its process group is gone once the fit ends)."""
    callbacks = [accord.callbacks.ModelCheckpoint(dirpath=save_to, save_last=True)]
    trainer = accord.Trainer(
        strategy=strategy,
        devices=devices,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=save_to is not None,
        callbacks=callbacks if save_to is not None else [],
        max_epochs=epochs,
        limit_train_batches=4,
    )
    model = AdamMLP(optimizer)
    trainer.fit(model, loader(batch_size=32 // devices), ckpt_path=ckpt_path)
    state = model.state_dict()
    if any(isinstance(value, DTensor) for value in state.values()):
        return {}
    return {key: value.detach().clone() for key, value in state.items()}


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------- FSDP sharded
def _fsdp_runs(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    sharded = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    _fit(sharded, 2, save_to=root / "fsdp")
    return {
        "uninterrupted": _fit("ddp", 4),
        "ddp_resumed": _fit("ddp", 4, ckpt_path=root / "fsdp" / "last.ckpt"),
    }


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """An FSDP x2 sharded checkpoint of 2 epochs, and DDP x2 runs with and without it."""
    root = tmp_path_factory.mktemp("fsdp_travel")
    return root, run_distributed(_fsdp_runs, 2, root, timeout=180)


def test_an_fsdp_sharded_checkpoint_resumes_under_ddp(
    fsdp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = fsdp_runs
    assert checkpoint_format(root / "fsdp" / "last.ckpt") == "fsdp_sharded"
    for result in results:
        _assert_same(result["ddp_resumed"], result["uninterrupted"])


def test_an_fsdp_sharded_checkpoint_resumes_on_one_device(
    fsdp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = fsdp_runs
    resumed = _fit("single_device", 4, devices=1, ckpt_path=root / "fsdp" / "last.ckpt")
    _assert_same(resumed, results[0]["uninterrupted"])


def test_a_sharded_checkpoint_reads_whole_with_adam_moments_and_scheduler(
    fsdp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = fsdp_runs
    checkpoint = read_checkpoint(root / "fsdp" / "last.ckpt")
    model = AdamMLP()
    model.load_state_dict(checkpoint["state_dict"])  # whole tensors, the module's own names
    (optimizer,) = checkpoint["optimizer_states"]
    assert set(optimizer["state"]) == {name for name, _ in model.named_parameters()}
    for name, parameter in model.named_parameters():
        assert optimizer["state"][name]["exp_avg"].shape == parameter.shape
        assert optimizer["state"][name]["exp_avg_sq"].abs().sum() > 0
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 2
    assert checkpoint["global_step"] == 8


# ------------------------------------------------------------------------ DeepSpeed
@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSpeed ZeRO-2 x2 checkpoint of 2 epochs."""
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    root = tmp_path_factory.mktemp("deepspeed_travel")
    run_distributed(_deepspeed_save, 2, root, timeout=240)
    return root / "last.ckpt"


def _deepspeed_save(rank: int, world_size: int, root: Path) -> None:
    _fit("deepspeed_stage_2", 2, save_to=root)


def test_a_deepspeed_checkpoint_is_recognized_where_a_file_is_expected(
    deepspeed_checkpoint: Path,
) -> None:
    assert checkpoint_format(deepspeed_checkpoint) == "deepspeed"
    with pytest.raises(CheckpointError, match="DeepSpeed checkpoint") as caught:
        load_checkpoint_file(deepspeed_checkpoint)
    assert "consolidate_deepspeed_checkpoint" in str(caught.value)


def _ddp_resume(rank: int, world_size: int, path: Path) -> dict[str, torch.Tensor]:
    return _fit("ddp", 4, ckpt_path=path)


def test_a_deepspeed_checkpoint_resumes_under_ddp_and_on_one_device(
    deepspeed_checkpoint: Path, fsdp_runs: tuple[Path, list[dict[str, Any]]]
) -> None:
    checkpoint = read_checkpoint(deepspeed_checkpoint)
    (optimizer,) = checkpoint["optimizer_states"]
    assert all("exp_avg_sq" in state for state in optimizer["state"].values())
    expected = fsdp_runs[1][0]["uninterrupted"]
    for weights in run_distributed(_ddp_resume, 2, deepspeed_checkpoint, timeout=180):
        _assert_same(weights, expected)
    _assert_same(_fit("single_device", 4, devices=1, ckpt_path=deepspeed_checkpoint), expected)


# --------------------------------------------------------------- FSDP, plain SGD
def _sgd_runs(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    # The weights are compared in full checkpoints, which FSDP writes from any run.
    _fit(FSDPStrategy(), 1, save_to=root / "first", optimizer="sgd")
    for name, ckpt_path in (("uninterrupted", None), ("resumed", root / "first" / "last.ckpt")):
        strategy = FSDPStrategy(state_dict_type="full")
        _fit(strategy, 2, save_to=root / name, ckpt_path=ckpt_path, optimizer="sgd")
    return {}


def _saved_weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_checkpoint_file(path)["state_dict"])


def test_fsdp_resumes_plain_sgd(tmp_path: Path) -> None:
    run_distributed(_sgd_runs, 2, tmp_path, timeout=180)
    resumed = _saved_weights(tmp_path / "resumed" / "last.ckpt")
    _assert_same(resumed, _saved_weights(tmp_path / "uninterrupted" / "last.ckpt"))
    assert not torch.equal(resumed["net.0.weight"], AdamMLP().net[0].weight)


# ------------------------------------------------------------------------- errors
def test_an_fsdp_directory_where_a_file_is_expected_says_what_it_is(
    fsdp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = fsdp_runs
    with pytest.raises(CheckpointError, match="FSDP sharded checkpoint") as caught:
        load_checkpoint_file(root / "fsdp" / "last.ckpt")
    assert "is a directory, not a checkpoint file" in str(caught.value)
    assert "any strategy" in str(caught.value)


def test_a_model_that_does_not_match_names_missing_and_unexpected_keys(
    fsdp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = fsdp_runs

    class Renamed(AdamMLP):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)
            del self.net[2]

    trainer = accord.Trainer(
        strategy="single_device", logger=False, enable_progress_bar=False, max_epochs=3
    )
    with pytest.raises(CheckpointError) as caught:
        trainer.fit(Renamed(), loader(batch_size=32), ckpt_path=root / "fsdp" / "last.ckpt")
    message = str(caught.value)
    assert "missing keys: extra.weight, extra.bias" in message
    assert "unexpected keys: net.2.weight, net.2.bias" in message


def test_a_checkpoint_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.ckpt"
    newer = CHECKPOINT_FORMAT_VERSION + 1
    torch.save({"accord_checkpoint_version": newer, "state_dict": {}}, path)
    with pytest.raises(CheckpointError, match=f"newer accord .*version {newer}"):
        load_checkpoint_file(path)
    trainer = accord.Trainer(strategy="single_device", logger=False, enable_progress_bar=False)
    with pytest.raises(CheckpointError, match="Upgrade accord"):
        trainer.fit(AdamMLP(), loader(batch_size=32), ckpt_path=path)
