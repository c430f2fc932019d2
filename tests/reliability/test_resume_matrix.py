"""A checkpoint saved mid-epoch under one strategy resumes under any other, at any world size.

Real runs over gloo. A fit of 3 epochs of 4 global batches of 24 (Adam, an LR that halves
every epoch) is saved at step 6, half-way through epoch 1, under single_device, ddp x2,
fsdp x2 (sharded), deepspeed_stage_2 x2 and deepspeed_stage_3 x2, and each checkpoint is
resumed under single_device, ddp x2, ddp x3, fsdp x2 and deepspeed_stage_2 x2. The global
batch is the same everywhere (24 = 1 x 24 = 2 x 12 = 3 x 8), so every resumed run must
end with the weights of the run that was never interrupted, and see the same samples: the
resumed epoch continues with the positions of the saving run's global order that no rank
had consumed, dealt over the new ranks. One process group per resuming strategy runs the
resumes of every saved checkpoint, one after the other.

Also, with a shuffled order: ddp x2 saved mid-epoch and resumed under ddp x3 and on one
device, and one device resumed under ddp x2, take each sample of the interrupted epoch
exactly once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from accord.checkpoint import load_checkpoint_file, read_checkpoint, save_checkpoint_file
from accord.errors import CheckpointError
from accord.testing import run_distributed
from accord.trainer.data import epoch_order, global_order, resume_loader, samples_per_batch
from tests.helpers.resume import (
    GLOBAL_BATCH,
    SAMPLES,
    SAVE_STEP,
    UNINTERRUPTED,
    MidEpochSaves,
    fit,
    indexed_data,
    saved_path,
)

RTOL, ATOL = 1e-5, 1e-5

SAVED = ("single_device", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
RESUMED = (
    ("single_device", 1),
    ("ddp", 2),
    ("ddp", 3),
    ("fsdp", 2),
    ("deepspeed_stage_2", 2),
)


def _joined(lists: Iterable[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return list(itertools.chain.from_iterable(lists))


def _final(root: Path, saved: str, resumed: str, devices: int) -> Path:
    return root / f"final-{saved}-to-{resumed}x{devices}.ckpt"


# ------------------------------------------------------------------------ the matrix
def _resume_all(rank: int, world_size: int, saves: Path, root: Path, name: str) -> dict[str, Any]:
    return {
        saved: fit(
            name,
            world_size,
            _final(root, saved, name, world_size),
            ckpt_path=saved_path(saves, saved),
        )
        for saved in SAVED
    }


@pytest.fixture(scope="module")
def matrix(
    mid_epoch_saves: MidEpochSaves, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, dict[str, Any]]:
    """Every saved checkpoint resumed under every strategy: where the saves are, where the
    resumed runs' checkpoints are, and the samples each run saw."""
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    saves, saved_seen = mid_epoch_saves
    root = tmp_path_factory.mktemp("resume_matrix")
    seen: dict[str, Any] = {"saved": saved_seen}
    for name, devices in RESUMED:
        if devices == 1:
            ranks = [_resume_all(0, 1, saves, root, name)]
        else:
            ranks = run_distributed(_resume_all, devices, saves, root, name, timeout=400)
        seen[f"{name}x{devices}"] = {key: _joined(r[key] for r in ranks) for key in ranks[0]}
    return saves, root, seen


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(read_checkpoint(path)["state_dict"])


@pytest.mark.parametrize("saved", SAVED)
@pytest.mark.parametrize(("resumed", "devices"), RESUMED)
def test_a_mid_epoch_checkpoint_resumes_under_every_strategy(
    matrix: tuple[Path, Path, dict[str, Any]], saved: str, resumed: str, devices: int
) -> None:
    saves, root, seen = matrix
    expected = _weights(saves / UNINTERRUPTED)
    actual = _weights(_final(root, saved, resumed, devices))
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=RTOL, atol=ATOL)
    before = seen["saved"][saved]
    after = seen[f"{resumed}x{devices}"][saved]
    assert Counter(before + after) == Counter(seen["saved"]["uninterrupted"])


def test_every_checkpoint_says_what_it_is(matrix: tuple[Path, Path, dict[str, Any]]) -> None:
    saves, _, _ = matrix
    for name in SAVED:
        checkpoint = read_checkpoint(saved_path(saves, name))
        assert checkpoint["world_size"] == (1 if name == "single_device" else 2)
        assert checkpoint["sharded"] == (name in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"))
        assert checkpoint["strategy"].endswith("Strategy")
        assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, SAVE_STEP)
        assert checkpoint["samples_consumed"] == 2 * GLOBAL_BATCH
        assert checkpoint["data_order"]["length"] == SAMPLES


# ---------------------------------------------------------------- a shuffled order
def _shuffled_save(rank: int, world_size: int, root: Path) -> list[tuple[int, int]]:
    return fit("ddp", world_size, root / "shuffled.ckpt", save_step=SAVE_STEP, shuffle=True)


def _shuffled_resume(rank: int, world_size: int, path: Path, final: Path) -> list[tuple[int, int]]:
    return fit("ddp", world_size, final, ckpt_path=path, shuffle=True)


def _each_once_in_epoch_one(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> None:
    epoch_one = [index for epoch, index in before + after if epoch == 1]
    assert sorted(epoch_one) == list(range(SAMPLES))
    assert Counter(e for e, _ in before) == {0: SAMPLES, 1: SAMPLES // 2}


def test_a_shuffled_epoch_resumes_on_another_world_size_with_the_samples_not_yet_seen(
    tmp_path: Path,
) -> None:
    before = _joined(run_distributed(_shuffled_save, 2, tmp_path, timeout=180))
    path = tmp_path / "shuffled.ckpt"
    after_3 = run_distributed(_shuffled_resume, 3, path, tmp_path / "x3.ckpt", timeout=180)
    _each_once_in_epoch_one(before, _joined(after_3))
    after_1 = fit("single_device", 1, tmp_path / "x1.ckpt", ckpt_path=path, shuffle=True)
    _each_once_in_epoch_one(before, after_1)
    # The rest of the epoch is the rest of the saving run's order, whatever the world size.
    rest_3 = sorted(i for e, i in _joined(after_3) if e == 1)
    assert rest_3 == sorted(i for e, i in after_1 if e == 1)


def test_a_shuffled_epoch_on_one_device_resumes_under_ddp(tmp_path: Path) -> None:
    path = tmp_path / "one.ckpt"
    before = fit("single_device", 1, path, save_step=SAVE_STEP, shuffle=True)
    after = _joined(run_distributed(_shuffled_resume, 2, path, tmp_path / "x2.ckpt", timeout=180))
    _each_once_in_epoch_one(before, after)


# ------------------------------------------------------- the order, in one process
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_recorded_order_is_the_order_the_ranks_took(shuffle: bool, ranks: int) -> None:
    dataset = indexed_data(10)  # 10 samples: 3 ranks pad the order to 12
    taken: list[int] = []
    order: dict[str, Any] | None = None
    for rank in range(ranks):
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=ranks, rank=rank, shuffle=shuffle, seed=7
        )
        sampler.set_epoch(3)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        order = epoch_order(loader, None)
        taken += list(sampler)
        assert samples_per_batch(loader, ranks) == 2 * ranks
    assert order is not None
    full = global_order(order)
    assert sorted(taken) == sorted(full)
    assert all(full[p] == i for p, i in _dealt(taken, ranks))


def _dealt(taken: list[int], ranks: int) -> list[tuple[int, int]]:
    """(position in the global order, index) of what each rank took, ranks in turn."""
    share = len(taken) // ranks
    return [(k * ranks + r, taken[r * share + k]) for r in range(ranks) for k in range(share)]


def test_a_random_sampler_order_is_replayed_from_the_rng_at_the_epoch_start() -> None:
    loader = DataLoader(indexed_data(), batch_size=8, shuffle=True)
    start = torch.get_rng_state()
    drawn = [int(i) for batch in loader for i in batch[2]]
    order = epoch_order(loader, start)
    assert order is not None and order["kind"] == "random"
    assert global_order(order) == drawn


def test_the_rest_of_an_epoch_is_dealt_over_the_new_ranks() -> None:
    order = {"kind": "sequential", "dataset_length": 10, "length": 10}
    loader = DataLoader(indexed_data(10), batch_size=2)
    parts = [
        [int(i) for batch in resume_loader(loader, order, 4, 3, rank) for i in batch[2]]
        for rank in range(3)
    ]
    # Positions 4..9 dealt round-robin over 3 ranks, each rank with as many.
    assert parts == [[4, 7], [5, 8], [6, 9]]
    assert [int(i) for b in resume_loader(loader, order, 10, 2, 0) for i in b[2]] == []


def test_an_order_accord_does_not_write_is_refused() -> None:
    with pytest.raises(CheckpointError, match="data order 'made-up'"):
        global_order({"kind": "made-up"})


def test_a_mid_epoch_resume_on_another_world_size_without_a_known_order_warns(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mid.ckpt"
    fit("single_device", 1, path, save_step=SAVE_STEP)
    checkpoint = load_checkpoint_file(path)
    # As a run on 2 ranks over an order accord cannot rebuild (an IterableDataset) saves it.
    checkpoint.update(world_size=2, data_order=None, samples_consumed=None)
    save_checkpoint_file(checkpoint, path)
    with pytest.warns(UserWarning, match="saved mid-epoch on 2 rank"):
        fit("single_device", 1, tmp_path / "final.ckpt", ckpt_path=path)
