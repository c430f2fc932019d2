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
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accord
from accord.callbacks import Callback
from accord.checkpoint import load_checkpoint_file, read_checkpoint, save_checkpoint_file
from accord.errors import CheckpointError
from accord.strategies import FSDPStrategy
from accord.testing import run_distributed
from accord.trainer.data import epoch_order, global_order, resume_loader, samples_per_batch

RTOL, ATOL = 1e-5, 1e-5
SAMPLES, GLOBAL_BATCH, EPOCHS, SAVE_STEP = 96, 24, 3, 6

SAVED = ("single_device", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
RESUMED = (
    ("single_device", 1),
    ("ddp", 2),
    ("ddp", 3),
    ("fsdp", 2),
    ("deepspeed_stage_2", 2),
)


class Recorder(accord.Module):
    """Two linear layers trained with Adam (LR halved every epoch); records each sample's
    index with the epoch it was trained in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 1))
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out.squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        epoch = self.trainer.current_epoch
        self.seen.extend((epoch, int(i)) for i in index.tolist())
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


class SaveAt(Callback):
    """Saves the training state to ``path`` once ``global_step`` reaches ``step`` (with
    ``step=None``, when the fit ends)."""

    def __init__(self, path: Path, step: int | None) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: accord.Trainer, module: accord.Module, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.step is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_fit_end(self, trainer: accord.Trainer, module: accord.Module) -> None:
        if self.step is None:
            trainer.save_checkpoint(self.path)


def _data(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=generator)
    y = x.sum(dim=1) + 0.1 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y, torch.arange(samples))


def _strategy(name: str) -> accord.strategies.Strategy | str:
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    return name


def _fit(
    name: str,
    devices: int,
    save: Path,
    *,
    save_step: int | None = None,
    ckpt_path: Path | None = None,
    shuffle: bool = False,
) -> list[tuple[int, int]]:
    """Fit under strategy ``name`` on ``devices`` ranks with the global batch of 24; save at
    ``save_step`` (and stop there) or at the end. Returns the (epoch, sample) pairs this
    rank trained on."""
    trainer = accord.Trainer(
        strategy=_strategy(name),
        devices=devices,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[SaveAt(save, save_step)],
        max_epochs=EPOCHS,
        max_steps=save_step if save_step is not None else -1,
    )
    model = Recorder()
    data = DataLoader(_data(), batch_size=GLOBAL_BATCH // devices, shuffle=shuffle)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.seen


def _joined(lists: Iterable[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return list(itertools.chain.from_iterable(lists))


def _saved(root: Path, name: str) -> Path:
    return root / f"saved-{name}.ckpt"


def _final(root: Path, saved: str, resumed: str, devices: int) -> Path:
    return root / f"final-{saved}-to-{resumed}x{devices}.ckpt"


# ------------------------------------------------------------------------ the matrix
def _save_all(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    seen = {"uninterrupted": _fit("ddp", 2, root / "uninterrupted.ckpt")}
    for name in SAVED[1:]:
        seen[name] = _fit(name, 2, _saved(root, name), save_step=SAVE_STEP)
    return seen


def _resume_all(rank: int, world_size: int, root: Path, name: str) -> dict[str, Any]:
    return {
        saved: _fit(
            name, world_size, _final(root, saved, name, world_size), ckpt_path=_saved(root, saved)
        )
        for saved in SAVED
    }


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Every saved checkpoint resumed under every strategy; the samples each run saw."""
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    root = tmp_path_factory.mktemp("resume_matrix")
    seen: dict[str, Any] = {}
    ranks = run_distributed(_save_all, 2, root, timeout=400)
    seen["saved"] = {key: _joined(r[key] for r in ranks) for key in ranks[0]}
    seen["saved"]["single_device"] = _fit(
        "single_device", 1, _saved(root, "single_device"), save_step=SAVE_STEP
    )
    for name, devices in RESUMED:
        if devices == 1:
            ranks = [_resume_all(0, 1, root, name)]
        else:
            ranks = run_distributed(_resume_all, devices, root, name, timeout=400)
        seen[f"{name}x{devices}"] = {key: _joined(r[key] for r in ranks) for key in ranks[0]}
    return root, seen


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(read_checkpoint(path)["state_dict"])


@pytest.mark.parametrize("saved", SAVED)
@pytest.mark.parametrize(("resumed", "devices"), RESUMED)
def test_a_mid_epoch_checkpoint_resumes_under_every_strategy(
    matrix: tuple[Path, dict[str, Any]], saved: str, resumed: str, devices: int
) -> None:
    root, seen = matrix
    expected = _weights(root / "uninterrupted.ckpt")
    actual = _weights(_final(root, saved, resumed, devices))
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=RTOL, atol=ATOL)
    before = seen["saved"][saved]
    after = seen[f"{resumed}x{devices}"][saved]
    assert Counter(before + after) == Counter(seen["saved"]["uninterrupted"])


def test_every_checkpoint_says_what_it_is(matrix: tuple[Path, dict[str, Any]]) -> None:
    root, _ = matrix
    for name in SAVED:
        checkpoint = read_checkpoint(_saved(root, name))
        assert checkpoint["world_size"] == (1 if name == "single_device" else 2)
        assert checkpoint["sharded"] == (name in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"))
        assert checkpoint["strategy"].endswith("Strategy")
        assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, SAVE_STEP)
        assert checkpoint["samples_consumed"] == 2 * GLOBAL_BATCH
        assert checkpoint["data_order"]["length"] == SAMPLES


# ---------------------------------------------------------------- a shuffled order
def _shuffled_save(rank: int, world_size: int, root: Path) -> list[tuple[int, int]]:
    return _fit("ddp", world_size, root / "shuffled.ckpt", save_step=SAVE_STEP, shuffle=True)


def _shuffled_resume(rank: int, world_size: int, path: Path, final: Path) -> list[tuple[int, int]]:
    return _fit("ddp", world_size, final, ckpt_path=path, shuffle=True)


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
    after_1 = _fit("single_device", 1, tmp_path / "x1.ckpt", ckpt_path=path, shuffle=True)
    _each_once_in_epoch_one(before, after_1)
    # The rest of the epoch is the rest of the saving run's order, whatever the world size.
    rest_3 = sorted(i for e, i in _joined(after_3) if e == 1)
    assert rest_3 == sorted(i for e, i in after_1 if e == 1)


def test_a_shuffled_epoch_on_one_device_resumes_under_ddp(tmp_path: Path) -> None:
    path = tmp_path / "one.ckpt"
    before = _fit("single_device", 1, path, save_step=SAVE_STEP, shuffle=True)
    after = _joined(run_distributed(_shuffled_resume, 2, path, tmp_path / "x2.ckpt", timeout=180))
    _each_once_in_epoch_one(before, after)


# ------------------------------------------------------- the order, in one process
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_recorded_order_is_the_order_the_ranks_took(shuffle: bool, ranks: int) -> None:
    dataset = _data(10)  # 10 samples: 3 ranks pad the order to 12
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
    loader = DataLoader(_data(), batch_size=8, shuffle=True)
    start = torch.get_rng_state()
    drawn = [int(i) for batch in loader for i in batch[2]]
    order = epoch_order(loader, start)
    assert order is not None and order["kind"] == "random"
    assert global_order(order) == drawn


def test_the_rest_of_an_epoch_is_dealt_over_the_new_ranks() -> None:
    order = {"kind": "sequential", "dataset_length": 10, "length": 10}
    loader = DataLoader(_data(10), batch_size=2)
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
    _fit("single_device", 1, path, save_step=SAVE_STEP)
    checkpoint = load_checkpoint_file(path)
    # As a run on 2 ranks over an order accord cannot rebuild (an IterableDataset) saves it.
    checkpoint.update(world_size=2, data_order=None, samples_consumed=None)
    save_checkpoint_file(checkpoint, path)
    with pytest.warns(UserWarning, match="saved mid-epoch on 2 rank"):
        _fit("single_device", 1, tmp_path / "final.ckpt", ckpt_path=path)
