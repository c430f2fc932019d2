"""One Lightning-style script, run under accord and under Lightning 2.6.6, agrees.

The script below is a template whose only difference between the two runs is its import
block: a LightningModule with ``self.log``/``log_dict``/``prog_bar``, an LR scheduler dict,
a DataModule, ``save_hyperparameters``, ``load_from_checkpoint``, ``LearningRateMonitor``,
``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` and ``EarlyStopping``. Each run
writes what it observed to a JSON file; the test compares the per-epoch logged numbers,
the checkpoint file names, the epoch early stopping ended on, the best checkpoint and the
final weights. accord runs in this project's venv; Lightning in the benchmarks' venv
(``make .venv-bench/.installed``), which holds ``pytorch-lightning==2.6.6`` with the same
torch. Without it the test is skipped.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import ROOT

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"

ACCORD_IMPORTS = """\
from accord import DataModule as LightningDataModule
from accord import Module as LightningModule
from accord import Trainer
from accord.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from accord.loggers import CSVLogger
"""

# The reference run gets the pause at exit that accord's processes take (accord.core.backend_threads,
# EXIT_SETTLE_SECONDS): without it a Lightning DDP rank can abort after a run that succeeded
# ("terminate called without an active exception"), when a gloo worker drops the autograd
# context it kept from a backward pass as the interpreter finalizes.
LIGHTNING_IMPORTS = """\
import atexit
import time

atexit.register(time.sleep, 0.1)
from pytorch_lightning import LightningDataModule, LightningModule, Trainer
from pytorch_lightning.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
)
from pytorch_lightning.loggers import CSVLogger
"""

SCRIPT = """\
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

{imports}

class Regressor(LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self(x)
        loss = nn.functional.mse_loss(prediction, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log_dict(
            {{"train_mae": (prediction - y).abs().mean()}},
            on_step=False,
            on_epoch=True,
            sync_dist=True,
        )
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {{
            "optimizer": optimizer,
            "lr_scheduler": {{"scheduler": scheduler, "interval": "epoch"}},
        }}


class Data(LightningDataModule):
    def setup(self, stage):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(80, 4, generator=generator)
        weight = torch.tensor([[1.0], [-2.0], [0.5], [0.0]])
        y = torch.tanh(x @ weight) + 0.3 * torch.randn(80, 1, generator=generator)
        self.train_set = TensorDataset(x[:64], y[:64])
        self.val_set = TensorDataset(x[64:], y[64:])

    def train_dataloader(self):
        # Under DDP Lightning shuffles the training DistributedSampler even for a loader in
        # order (accord follows the loader), so the loader shuffles there. On one device
        # it keeps its order: from the second epoch on Lightning's shuffled order is not
        # the plain loader's (accord's is).
        generator = torch.Generator().manual_seed(7)
        shuffle = self.trainer.world_size > 1
        return DataLoader(self.train_set, batch_size=8, shuffle=shuffle, generator=generator)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=8)


class Record(Callback):
    def __init__(self):
        self.seen = []

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        self.seen.append([float(metrics[k]) for k in ("train_loss", "train_mae", "val_loss")])


def main(out: Path, strategy: str, devices: int) -> None:
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=2)
    stopping = EarlyStopping(monitor="val_loss", patience=2, min_delta=0.01)
    record = Record()
    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=30,
        logger=CSVLogger(out, name="logs", version=0),
        callbacks=[LearningRateMonitor(logging_interval="epoch"), checkpoints, stopping, record],
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    model = Regressor(lr=0.05)
    trainer.fit(model, datamodule=Data())
    if not trainer.is_global_zero:
        return
    best = Regressor.load_from_checkpoint(checkpoints.best_model_path)
    result = {{
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "stopped_epoch": stopping.stopped_epoch,
        "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
        "best_model_path": Path(checkpoints.best_model_path).name,
        "best_model_score": float(checkpoints.best_model_score),
        "best_hparams": dict(best.hparams),
        "callback_metrics": record.seen,
        "weights": {{k: v.flatten().tolist() for k, v in model.state_dict().items()}},
        "best_weights": {{k: v.flatten().tolist() for k, v in best.state_dict().items()}},
    }}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
"""


MANUAL_SCRIPT = """\
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.functional import softplus
from torch.utils.data import DataLoader, TensorDataset

{imports}

class GAN(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Linear(2, 4)
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        real, noise = batch
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(d_opt)
        fake = self.generator(noise)
        d_loss = (
            softplus(-self.discriminator(real)).mean()
            + softplus(self.discriminator(fake.detach())).mean()
        )
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, 0.5)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        # The generator accumulates two batches per step.
        stepping = (batch_idx + 1) % 2 == 0
        with g_opt.toggle_model(sync_grad=stepping):
            g_loss = softplus(-self.discriminator(self.generator(noise))).mean() / 2
            self.manual_backward(g_loss)
        if stepping:
            g_opt.step()
            g_opt.zero_grad()
            self.lr_schedulers().step()
        self.log("d_loss", d_loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("g_loss", g_loss, on_step=False, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        return [g_opt, d_opt], [torch.optim.lr_scheduler.StepLR(g_opt, 1, gamma=0.9)]



def main(out: Path, strategy: str, devices: int) -> None:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(32, 4, generator=generator), torch.randn(32, 2, generator=generator)
    )
    # Shuffled under DDP, as Lightning shuffles there whatever the loader says.
    loader = DataLoader(
        data, batch_size=4, shuffle=devices > 1, generator=torch.Generator().manual_seed(7)
    )
    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=2,
        logger=CSVLogger(out, name="logs", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = GAN()
    trainer.fit(model, loader)
    if not trainer.is_global_zero:
        return
    result = {{
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "weights": {{k: v.flatten().tolist() for k, v in model.state_dict().items()}},
    }}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
"""


def _lightning_missing() -> str | None:
    """Why the Lightning side cannot run, or None when it can."""
    if not BENCH_PYTHON.exists():
        return f"{BENCH_PYTHON} does not exist (make .venv-bench/.installed creates it)"
    probe = subprocess.run(
        [str(BENCH_PYTHON), "-c", "import pytorch_lightning"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{BENCH_PYTHON} cannot import pytorch_lightning: {last}"
    return None


def _run(
    python: Path | str,
    imports: str,
    out: Path,
    strategy: str,
    devices: int,
    template: str = SCRIPT,
) -> dict[str, Any]:
    out.mkdir()
    script = out / "train.py"
    script.write_text(template.format(imports=imports))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(python), str(script), str(out), strategy, str(devices)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=out,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["csv"] = _logged_metrics(out / "logs" / "version_0" / "metrics.csv")
    return result


def _logged_metrics(path: Path) -> dict[str, dict[str, float]]:
    """Each logged metric by the ``epoch``/``step`` of its row in the CSV log (the
    LR monitor's rows have no epoch)."""
    metrics: dict[str, dict[str, float]] = {}
    with path.open() as handle:
        for row in csv.DictReader(handle):
            where = f"epoch={row.get('epoch', '')} step={row['step']}"
            for key, value in row.items():
                if key in ("epoch", "step") or value in ("", None):
                    continue
                metrics.setdefault(key, {})[where] = float(value)
    return metrics


def _by_epoch(by_row: dict[str, float]) -> dict[str, float]:
    """The values of `_logged_metrics` keyed by their epoch alone."""
    return {where.split()[0].removeprefix("epoch="): value for where, value in by_row.items()}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize(("strategy", "devices"), [("single_device", 1), ("ddp", 2)])
def test_the_same_script_trains_the_same_under_accord_and_lightning(
    strategy: str, devices: int, tmp_path: Path
) -> None:
    missing = _lightning_missing()
    if missing is not None:
        pytest.skip(missing)
    ours = _run(sys.executable, ACCORD_IMPORTS, tmp_path / "accord", strategy, devices)
    theirs = _run(BENCH_PYTHON, LIGHTNING_IMPORTS, tmp_path / "lightning", strategy, devices)

    # Early stopping ends on the same epoch, after the same number of steps.
    assert ours["stopped_epoch"] == theirs["stopped_epoch"]
    assert ours["current_epoch"] == theirs["current_epoch"]
    assert ours["global_step"] == theirs["global_step"]
    assert 0 < theirs["current_epoch"] < 30, "the script should stop early"

    # Every logged number (train_loss, train_mae, val_loss per epoch; lr-SGD), under the
    # same names, at the same epoch and step of the CSV log.
    logged = {"train_loss", "train_mae", "val_loss", "lr-SGD"}
    assert ours["csv"].keys() == logged
    assert theirs["csv"].keys() == logged
    for key, by_row in theirs["csv"].items():
        assert ours["csv"][key].keys() == by_row.keys(), key
        for where, value in by_row.items():
            assert _close(ours["csv"][key][where], value), (key, where)
    assert len(theirs["csv"]["lr-SGD"]) == theirs["current_epoch"]
    # What a callback reads in trainer.callback_metrics at the end of each epoch.
    assert len(ours["callback_metrics"]) == len(theirs["callback_metrics"])
    for mine, lightning in zip(ours["callback_metrics"], theirs["callback_metrics"], strict=True):
        assert all(_close(a, b) for a, b in zip(mine, lightning, strict=True))

    # The same two checkpoints kept, named alike; the same best one, loaded back with its
    # hyperparameters.
    assert ours["checkpoints"] == theirs["checkpoints"]
    assert len(ours["checkpoints"]) == 2
    assert ours["best_model_path"] == theirs["best_model_path"]
    assert _close(ours["best_model_score"], theirs["best_model_score"])
    assert ours["best_hparams"] == theirs["best_hparams"] == {"lr": 0.05, "hidden": 8}

    for name in ("weights", "best_weights"):
        assert ours[name].keys() == theirs[name].keys()
        for key, values in theirs[name].items():
            assert all(_close(a, b) for a, b in zip(ours[name][key], values, strict=True)), (
                name,
                key,
            )


@pytest.mark.parametrize(
    ("strategy", "devices"), [("single_device", 1), ("ddp_find_unused_parameters_true", 2)]
)
def test_manual_optimization_trains_the_same_under_accord_and_lightning(
    strategy: str, devices: int, tmp_path: Path
) -> None:
    """A GAN with two optimizers, toggle_optimizer, clip_gradients and its generator's
    gradients accumulated by hand with ``toggle_model(sync_grad=...)``."""
    missing = _lightning_missing()
    if missing is not None:
        pytest.skip(missing)
    ours = _run(
        sys.executable, ACCORD_IMPORTS, tmp_path / "accord", strategy, devices, MANUAL_SCRIPT
    )
    theirs = _run(
        BENCH_PYTHON, LIGHTNING_IMPORTS, tmp_path / "lightning", strategy, devices, MANUAL_SCRIPT
    )
    # Every optimizer step counts: per epoch a discriminator step per batch (8 / devices
    # batches of 4 on each rank) and a generator step every 2 batches.
    batches = 8 // devices
    assert ours["global_step"] == theirs["global_step"] == 2 * (batches + batches // 2)
    assert ours["current_epoch"] == theirs["current_epoch"] == 2
    # The epoch means, by epoch. (The CSV's step column differs here: Lightning's counts
    # batches under manual optimization, accord's optimizer steps.)
    assert ours["csv"].keys() == theirs["csv"].keys() == {"d_loss", "g_loss"}
    for key, by_row in theirs["csv"].items():
        mine = _by_epoch(ours["csv"][key])
        lightning = _by_epoch(by_row)
        assert mine.keys() == lightning.keys() == {"0", "1"}, key
        for epoch, value in lightning.items():
            assert _close(mine[epoch], value), (key, epoch)
    assert ours["weights"].keys() == theirs["weights"].keys()
    for key, values in theirs["weights"].items():
        assert all(_close(a, b) for a, b in zip(ours["weights"][key], values, strict=True)), key


ACCORD_FEATURE_IMPORTS = (
    ACCORD_IMPORTS
    + "from accord import seed_everything\nimport accord.module as lightning_module\n"
)
LIGHTNING_FEATURE_IMPORTS = (
    LIGHTNING_IMPORTS
    + "from pytorch_lightning import seed_everything\nimport pytorch_lightning as lightning_module\n"
)

FEATURES_SCRIPT = """\
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

{imports}

calls = []


class Net(LightningModule):
    def __init__(self, lr: float = 0.2, warmup: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        calls.append(f"estimated_stepping_batches={{total}}")
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=total
        )
        return {{"optimizer": optimizer, "lr_scheduler": {{"scheduler": scheduler, "interval": "step"}}}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        # A warm-up on top of the schedule: the first steps take a smaller one.
        scale = min(1.0, (self.trainer.global_step + 1) / self.hparams.warmup)
        for group in optimizer.param_groups:
            group["lr"] *= scale
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] /= scale


def record(cls, names, kind):
    for name in names:
        original = getattr(cls, name)

        def wrapper(self, *args, __name=name, __original=original, **kwargs):
            calls.append(f"{{kind}} {{__name}}")
            return __original(self, *args, **kwargs)

        setattr(cls, name, wrapper)


class Collect(Callback):
    def __init__(self):
        self.seen = []
        self.sanity = 0

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            self.sanity += 1
            return
        self.seen.append(float(trainer.callback_metrics["val_loss"]))


record(
    Net,
    [n for n in dir(LightningModule) if n.startswith("on_") and n != "on_gpu"]
    + ["optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping", "backward"],
    "M",
)
record(Collect, ["on_train_batch_start", "on_before_optimizer_step", "on_sanity_check_start", "on_train_epoch_end"], "C")


class EpochPermutation(Sampler):
    # The order a two-rank DistributedSampler deals out, as one device's order.
    def __init__(self, length, seed):
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self):
        return self.length


def main(out: Path, strategy: str, devices: int, mode: str) -> None:
    seed_everything(7)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=generator)
    y = torch.tanh(x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]])) + 0.1 * torch.randn(128, 1, generator=generator)
    train, val = TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])
    if mode == "global":
        # One device with the two ranks' batches together (what sync_batchnorm computes).
        train_loader = DataLoader(train, batch_size=8, sampler=EpochPermutation(96, 7))
        val_loader = DataLoader(val, batch_size=16)
    else:
        train_loader = DataLoader(train, batch_size=4, shuffle=True)
        val_loader = DataLoader(val, batch_size=8)
    collect = Collect()
    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        gradient_clip_algorithm="value",
        sync_batchnorm=mode == "sync",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[collect],
    )
    model = Net()
    trainer.fit(model, train_loader, val_loader)
    result = {{
        "global_step": trainer.global_step,
        "sanity": collect.sanity,
        "val_loss": collect.seen,
        "calls": calls,
        "weights": {{k: v.flatten().tolist() for k, v in model.state_dict().items()}},
    }}
    (out / f"result-{{trainer.global_rank}}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
"""


def _run_features(
    python: Path | str, imports: str, out: Path, strategy: str, devices: int, mode: str
) -> dict[str, Any]:
    out.mkdir()
    script = out / "train.py"
    script.write_text(FEATURES_SCRIPT.format(imports=imports))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(python), str(script), str(out), strategy, str(devices), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=out,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads((out / "result-0.json").read_text()))


def _same_numbers(ours: dict[str, Any], theirs: dict[str, Any], tol: float = 1e-5) -> None:
    assert ours["global_step"] == theirs["global_step"]
    assert len(ours["val_loss"]) == len(theirs["val_loss"]) == 3
    for a, b in zip(ours["val_loss"], theirs["val_loss"], strict=True):
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), (a, b)
    assert ours["weights"].keys() == theirs["weights"].keys()
    for key, values in theirs["weights"].items():
        for a, b in zip(ours["weights"][key], values, strict=True):
            assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), (key, a, b)


@pytest.mark.parametrize(("strategy", "devices"), [("single_device", 1), ("ddp", 2)])
def test_lightning_features_train_the_same_under_accord_and_lightning(
    strategy: str, devices: int, tmp_path: Path
) -> None:
    """The sanity check, OneCycleLR sized by estimated_stepping_batches, a warm-up in an
    optimizer_step override, accumulation, clipping by value, BatchNorm, shuffled data, a
    callback reading the validation metrics in on_validation_epoch_end: the same hook calls
    and the same numbers as Lightning."""
    missing = _lightning_missing()
    if missing is not None:
        pytest.skip(missing)
    mode = "sync" if devices == 1 else "plain"
    ours = _run_features(
        sys.executable, ACCORD_FEATURE_IMPORTS, tmp_path / "accord", strategy, devices, mode
    )
    theirs = _run_features(
        BENCH_PYTHON, LIGHTNING_FEATURE_IMPORTS, tmp_path / "lightning", strategy, devices, mode
    )
    assert ours["calls"] == theirs["calls"]
    assert ours["sanity"] == theirs["sanity"] == 1
    _same_numbers(ours, theirs)


def test_sync_batchnorm_on_two_ranks_trains_as_one_device_with_both_batches(
    tmp_path: Path,
) -> None:
    """Lightning's sync_batchnorm needs a GPU (torch's SyncBatchNorm); accord's runs on CPU.
    BatchNorm over two ranks' batches is BatchNorm over both batches at once, so accord's
    ddp x2 with sync_batchnorm must give the numbers Lightning gives on one device with the
    two ranks' batches together, in the order the distributed sampler deals them."""
    missing = _lightning_missing()
    if missing is not None:
        pytest.skip(missing)
    ours = _run_features(
        sys.executable, ACCORD_FEATURE_IMPORTS, tmp_path / "accord", "ddp", 2, "sync"
    )
    theirs = _run_features(
        BENCH_PYTHON,
        LIGHTNING_FEATURE_IMPORTS,
        tmp_path / "lightning",
        "single_device",
        1,
        "global",
    )
    _same_numbers(ours, theirs, tol=1e-4)
