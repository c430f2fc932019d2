"""``python -m accord.checkpoint``: inspect and convert real checkpoints, without a training job.

Checkpoints are written by real runs (one device, and ddp, fsdp, deepspeed_stage_2 and
deepspeed_stage_3 on 2 ranks over gloo), saved half-way through an epoch; the command runs
as a subprocess on each. A converted checkpoint holds the same tensors as its source, and a
sharded directory written by the command in one process resumes an FSDP fit on 2 and on
3 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accord.checkpoint import checkpoint_format, load_checkpoint_file, read_checkpoint
from accord.testing import run_distributed
from tests.helpers.resume import SAMPLES, SAVE_STEP, MidEpochSaves, fit, saved_path

SAVED = ("single_device", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
SHARDED = {"fsdp", "deepspeed_stage_2", "deepspeed_stage_3"}


@pytest.fixture(scope="module")
def saved(mid_epoch_saves: MidEpochSaves) -> Path:
    """A mid-epoch checkpoint of each strategy."""
    return mid_epoch_saves[0]


def _command(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-m", "accord.checkpoint", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def _path(root: Path, name: str) -> Path:
    path = saved_path(root, name)
    if not path.exists():
        pytest.skip(f"no {name} checkpoint (needs deepspeed: pip install 'accord[deepspeed]')")
    return path


def _same_tensors(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected)
        for key, value in expected.items():
            _same_tensors(actual[key], value)


@pytest.mark.parametrize("name", SAVED)
def test_inspect_says_what_a_checkpoint_is(saved: Path, name: str) -> None:
    result = _command("inspect", _path(saved, name))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "format version 1" in out
    assert f"world size {1 if name == 'single_device' else 2}" in out
    assert f"layout:      {'sharded' if name in SHARDED else 'full'}" in out
    assert f"epoch 1, global step {SAVE_STEP}, mid-epoch" in out
    assert f"48 of the epoch's {SAMPLES} samples consumed" in out
    assert "model:       4 tensors, 131 elements, 524 B" in out
    assert "optimizer 0: state for 4 parameters (exp_avg, exp_avg_sq, step)" in out
    assert "net.0.weight  [13, 8]  float32" in out


@pytest.mark.parametrize("name", SAVED)
def test_convert_to_full_keeps_every_tensor(saved: Path, name: str, tmp_path: Path) -> None:
    source = _path(saved, name)
    target = tmp_path / "full.ckpt"
    result = _command("convert", source, target, "--to", "full")
    assert result.returncode == 0, result.stderr
    converted = load_checkpoint_file(target)
    original = read_checkpoint(source)
    assert converted["sharded"] is False
    _same_tensors(converted["state_dict"], original["state_dict"])
    _same_tensors(
        converted["optimizer_states"][0]["state"], original["optimizer_states"][0]["state"]
    )
    assert converted["samples_consumed"] == original["samples_consumed"] == 48


def _fsdp_resume(rank: int, world_size: int, source: Path, final: Path) -> list[tuple[int, int]]:
    return fit("fsdp", world_size, final, ckpt_path=source)


@pytest.mark.parametrize("name", SAVED)
def test_convert_to_sharded_keeps_every_tensor_keyed_by_name(
    saved: Path, name: str, tmp_path: Path
) -> None:
    source = _path(saved, name)
    target = tmp_path / "sharded.ckpt"
    result = _command("convert", source, target, "--to", "sharded", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    assert checkpoint_format(target) == "fsdp_sharded"
    converted, original = read_checkpoint(target), read_checkpoint(source)
    assert (converted["world_size"], converted["sharded"]) == (4, True)
    _same_tensors(converted["state_dict"], original["state_dict"])
    state = converted["optimizer_states"][0]["state"]
    assert set(state) == set(original["state_dict"])  # keyed by the parameters' names
    for key, value in state.items():
        assert value["exp_avg"].shape == original["state_dict"][key].shape


def test_a_sharded_directory_written_in_one_process_resumes_fsdp_on_2_and_3_ranks(
    saved: Path, tmp_path: Path
) -> None:
    source = saved_path(saved, "deepspeed_stage_3")
    if not source.exists():
        source = saved_path(saved, "ddp")
    target = tmp_path / "sharded.ckpt"
    assert _command("convert", source, target, "--to", "sharded").returncode == 0
    seen = {}
    for ranks in (2, 3):
        final = tmp_path / f"x{ranks}"
        runs = run_distributed(_fsdp_resume, ranks, target, final, timeout=240)
        seen[ranks] = sorted(i for run in runs for epoch, i in run if epoch == 1)
        assert read_checkpoint(final)["global_step"] == 12
    # The rest of the interrupted epoch (in order: the loader does not shuffle), dealt
    # over 2 or over 3 ranks.
    assert seen[2] == seen[3] == list(range(SAMPLES // 2, SAMPLES))


def test_bad_input_says_what_is_wrong(tmp_path: Path) -> None:
    missing = _command("inspect", tmp_path / "nothing.ckpt")
    assert missing.returncode == 2
    assert "No checkpoint at" in missing.stderr
    (tmp_path / "a.ckpt").write_bytes(b"")
    wrong = _command(
        "convert", tmp_path / "a.ckpt", tmp_path / "b", "--to", "full", "--world-size", "2"
    )
    assert wrong.returncode == 2
    assert "only with --to sharded" in wrong.stderr
