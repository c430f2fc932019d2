"""Lightning's Trainer arguments and properties, with Lightning's meaning, as a user sets
them: each test runs real fits on one device (two gloo ranks where ranks matter)."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

import accord
from accord.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, Timer, TQDMProgressBar
from accord.environments import LocalEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader


def _trainer(tmp_path: Path, **kwargs: Any) -> accord.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return accord.Trainer(**options)


class Counting(LinearModel):
    """Counts its validation passes and training batches."""

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0
        self.batches = 0

    def on_validation_epoch_end(self) -> None:
        self.validations += 1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1


def test_the_sanity_check_runs_two_batches_first_and_keeps_nothing(tmp_path: Path) -> None:
    seen: list[tuple[bool, int]] = []

    class Watch(Counting):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append((self.trainer.sanity_checking, batch_idx))
            super().validation_step(batch, batch_idx)

    model = Watch()
    trainer = _trainer(tmp_path, max_epochs=1, limit_val_batches=3)
    trainer.fit(model, loader(32), loader(32))
    assert seen[:2] == [(True, 0), (True, 1)]
    assert seen[2:] == [(False, 0), (False, 1), (False, 2)]
    assert model.validations == 2
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    model = Watch()
    seen.clear()
    trainer.fit(model, loader(32), loader(32))
    assert not any(sanity for sanity, _ in seen) and model.validations == 1


def test_fast_dev_run_runs_one_batch_of_each_loader_and_saves_nothing(tmp_path: Path) -> None:
    model = Counting()
    trainer = accord.Trainer(
        accelerator="cpu", fast_dev_run=True, default_root_dir=tmp_path, enable_progress_bar=False
    )
    trainer.fit(model, loader(8), loader(8))
    assert trainer.global_step == 1 and model.batches == 1 and model.validations == 1
    assert trainer.loggers == [] and trainer.checkpoint_callback is None
    assert not any(tmp_path.iterdir()), "fast_dev_run writes no logs or checkpoints"
    trainer = accord.Trainer(accelerator="cpu", fast_dev_run=3, enable_progress_bar=False)
    model = Counting()
    trainer.fit(model, loader(8), loader(8))
    assert trainer.global_step == 3 and trainer.current_epoch == 1
    [metrics] = trainer.test(model, loader(8), verbose=False)
    assert trainer.num_test_batches == [3] and "test_loss" in metrics


def test_overfit_batches_trains_and_validates_on_the_first_batches_in_order(
    tmp_path: Path,
) -> None:
    orders: list[list[float]] = []

    class Record(Counting):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            orders.append(batch[1][:2].tolist())
            return super().training_step(batch, batch_idx)

    trainer = _trainer(tmp_path, max_epochs=2, overfit_batches=2, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="overfit_batches turns off"):
        trainer.fit(Record(), loader(8, shuffle=True), loader(8))
    assert trainer.global_step == 4
    assert orders[:2] == orders[2:], "the same two batches, in the same order, each epoch"
    assert trainer.num_val_batches == [2]


def test_min_epochs_and_min_steps_hold_off_a_stop(tmp_path: Path) -> None:
    class Stopper(Counting):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(outputs, batch, batch_idx)
            self.trainer.should_stop = True

    trainer = _trainer(tmp_path, max_epochs=10, min_epochs=3, limit_train_batches=4)
    trainer.fit(Stopper(), loader(8))
    assert trainer.current_epoch == 3
    trainer = _trainer(tmp_path, max_epochs=10, min_steps=6, limit_train_batches=4)
    trainer.fit(Stopper(), loader(8))
    assert trainer.global_step == 6


def test_max_time_stops_the_fit(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_epochs=1000, max_time=timedelta(seconds=1))
    assert any(isinstance(cb, Timer) for cb in trainer.callbacks)
    trainer.fit(LinearModel(), loader(8))
    assert 0 < trainer.current_epoch < 1000


def test_gradient_clip_algorithm_value_clamps_every_element(tmp_path: Path) -> None:
    grads: list[torch.Tensor] = []

    class Spy(LinearModel):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            grads.append(self.layer.weight.grad.detach().clone())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = _trainer(
        tmp_path, max_steps=1, gradient_clip_val=0.01, gradient_clip_algorithm="value"
    )
    model = Spy()
    trainer.fit(model, loader(8))
    # on_before_optimizer_step sees the gradient before clipping, the weights after it.
    assert grads[0].abs().max() > 0.01
    assert model.layer.weight.grad is not None
    assert model.layer.weight.grad.abs().max() <= 0.01 + 1e-7
    with pytest.raises(ConfigurationError, match="gradient_clip_algorithm='spiky'"):
        _trainer(tmp_path, gradient_clip_val=1.0, gradient_clip_algorithm="spiky")


def _ddp(**kwargs: Any) -> accord.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "strategy": "ddp",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return accord.Trainer(**options)


def _own_sampler(rank: int, world_size: int) -> tuple[str, int]:
    trainer = _ddp(max_epochs=1, use_distributed_sampler=False)
    trainer.fit(LinearModel(), loader(8, samples=64, shuffle=True))
    return type(trainer.train_dataloader.sampler).__name__, trainer.num_training_batches


def test_use_distributed_sampler_false_keeps_the_users_sampler() -> None:
    for sampler, batches in run_distributed(_own_sampler, 2, timeout=120):
        assert sampler == RandomSampler.__name__ and batches == 8


class _Record(accord.Module):
    """Records the sample indices of each training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.extend(int(v) for v in batch[0].flatten())
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _orders(rank: int, world_size: int) -> list[list[int]]:
    orders = []
    data = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1))
    for seed in (1, 2, 1):
        accord.seed_everything(seed)
        model = _Record()
        _ddp(max_epochs=1, limit_train_batches=1).fit(
            model, DataLoader(data, batch_size=8, shuffle=True)
        )
        orders.append(model.seen)
    return orders


def test_the_seed_changes_the_distributed_order_as_in_lightning() -> None:
    for rank, (first, second, again) in enumerate(run_distributed(_orders, 2, timeout=180)):
        assert first != second, "another seed, another order"
        assert first == again, "the same seed, the same order"
        # DistributedSampler(seed=1): Lightning seeds its sampler from seed_everything too.
        expected = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
        assert first == expected[rank::2][:8]


def test_reload_dataloaders_every_n_epochs_asks_the_hook_again(tmp_path: Path) -> None:
    class Reloading(LinearModel):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def train_dataloader(self) -> DataLoader[Any]:
            self.asked += 1
            return loader(16, samples=32 * self.asked)

    model = Reloading()
    trainer = _trainer(tmp_path, max_epochs=4, reload_dataloaders_every_n_epochs=2)
    trainer.fit(model)
    assert model.asked == 2
    # 2 batches in epochs 0-1, 4 in epochs 2-3.
    assert trainer.global_step == 2 + 2 + 4 + 4


def test_inference_mode_and_detect_anomaly(tmp_path: Path) -> None:
    modes: list[tuple[bool, bool]] = []

    class Watch(LinearModel):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    _trainer(tmp_path).test(Watch(), loader(256), verbose=False)
    _trainer(tmp_path, inference_mode=False).test(Watch(), loader(256), verbose=False)
    assert modes == [(True, False), (False, False)]

    anomalies: list[bool] = []

    class Anomaly(LinearModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            anomalies.append(torch.is_anomaly_enabled())
            return super().training_step(batch, batch_idx)

    _trainer(tmp_path, max_steps=1, detect_anomaly=True).fit(Anomaly(), loader(8))
    assert anomalies == [True] and not torch.is_anomaly_enabled()


def test_the_default_callbacks_follow_the_flags(tmp_path: Path) -> None:
    trainer = accord.Trainer(accelerator="cpu", default_root_dir=tmp_path)
    kinds = [type(cb) for cb in trainer.callbacks]
    assert kinds == [ModelSummary, TQDMProgressBar, ModelCheckpoint]
    assert trainer.checkpoint_callback is trainer.checkpoint_callbacks[0]
    assert trainer.progress_bar_callback is trainer.callbacks[1]
    stop = EarlyStopping("val_loss")
    trainer = _trainer(tmp_path, callbacks=[stop])
    assert trainer.early_stopping_callback is stop and trainer.early_stopping_callbacks == [stop]
    bare = accord.Trainer(accelerator="cpu", barebones=True)
    assert bare.callbacks == [] and bare.loggers == [] and bare.num_sanity_val_steps == 0
    with pytest.raises(ConfigurationError, match="barebones=True, enable_checkpointing=True"):
        accord.Trainer(accelerator="cpu", barebones=True, enable_checkpointing=True)


def test_barebones_refuses_self_log(tmp_path: Path) -> None:
    trainer = accord.Trainer(accelerator="cpu", barebones=True, max_steps=1)
    with pytest.raises(ConfigurationError, match="barebones"):
        trainer.fit(LinearModel(), loader(8))


def test_plugins_take_a_precision_or_an_environment_and_refuse_the_rest(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, plugins=[Precision("bf16-mixed"), LocalEnvironment()])
    assert trainer.precision == "bf16-mixed"
    assert isinstance(trainer.strategy.cluster_environment, LocalEnvironment)
    with pytest.raises(ConfigurationError, match="plugins= got 'AsyncCheckpointIO'"):
        _trainer(tmp_path, plugins="AsyncCheckpointIO")
    with pytest.raises(ConfigurationError, match="model registry"):
        _trainer(tmp_path, model_registry="mine")
    with pytest.raises(ConfigurationError, match="profiler='simple'"):
        _trainer(tmp_path, profiler="simple")


def test_estimated_stepping_batches_counts_accumulation_limits_and_ranks(
    tmp_path: Path,
) -> None:
    found: list[int | float] = []

    class Sized(LinearModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            found.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    _trainer(tmp_path, max_epochs=3, accumulate_grad_batches=3).fit(Sized(), loader(8, 80))
    _trainer(tmp_path, max_epochs=3, limit_train_batches=4).fit(Sized(), loader(8, 80))
    _trainer(tmp_path, max_epochs=3, max_steps=5).fit(Sized(), loader(8, 80))
    assert found == [3 * math.ceil(10 / 3), 12, 5]
    with pytest.raises(ConfigurationError, match="during fit"):
        _ = _trainer(tmp_path).estimated_stepping_batches

    assert run_distributed(_ranked_estimate, 2, timeout=120) == [10, 10]


class _Sized(LinearModel):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[int | float] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.found.append(self.trainer.estimated_stepping_batches)
        return super().configure_optimizers()


def _ranked_estimate(rank: int, world_size: int) -> int | float:
    model = _Sized()
    _ddp(max_epochs=2).fit(model, loader(8, 80))
    return model.found[0]


def test_the_properties_say_where_the_run_is(tmp_path: Path) -> None:
    stages: list[tuple[str, bool, bool, bool]] = []

    class Watch(LinearModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            trainer = self.trainer
            stages.append(("train", trainer.training, trainer.validating, trainer.is_last_batch))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            trainer = self.trainer
            stages.append(("val", trainer.training, trainer.validating, trainer.sanity_checking))

    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=1, limit_val_batches=1)
    model = Watch()
    trainer.fit(model, loader(32), loader(32))
    # The sanity check, the epoch's 8 batches (the last one known as such), validation.
    assert stages[0] == ("val", False, True, True)
    assert [s[:3] for s in stages[1:9]] == [("train", True, False)] * 8
    assert [s[3] for s in stages[1:9]] == [False] * 7 + [True]
    assert stages[9:] == [("val", False, True, False)]
    assert trainer.lightning_module is model and trainer.model is model
    assert trainer.num_devices == 1 and trainer.device_ids == [0] and trainer.node_rank == 0
    assert trainer.num_val_batches == [1] and trainer.num_sanity_val_batches == [1]
    assert not trainer.interrupted and not trainer.received_sigterm and trainer.ckpt_path is None
    assert trainer.train_dataloader is not None and trainer.val_dataloaders is not None
    assert trainer.precision == "32-true" and trainer.scaler is None
    assert trainer.enable_validation


def test_a_failed_run_says_it_was_interrupted(tmp_path: Path) -> None:
    class Broken(LinearModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise KeyError("boom")

    trainer = _trainer(tmp_path, max_steps=1)
    with pytest.raises(KeyError):
        trainer.fit(Broken(), loader(8))
    assert trainer.interrupted


def test_validate_without_a_model_uses_the_best_checkpoint(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss")
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(LinearModel(), loader(32), loader(32))
    [metrics] = trainer.validate(dataloaders=loader(32), verbose=False)
    assert trainer.ckpt_path == checkpoint.best_model_path and "val_loss" in metrics
    with pytest.raises(ConfigurationError, match="needs a model"):
        _trainer(tmp_path).test()


class _Ids(LinearModel):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[1]


def _predicted(rank: int, world_size: int) -> list[float]:
    data = torch.utils.data.TensorDataset(torch.zeros(7, 8), torch.arange(7.0))
    outputs = _ddp().predict(_Ids(), DataLoader(data, batch_size=2))
    assert outputs is not None
    return torch.cat(outputs).tolist()


def test_predict_on_two_ranks_sees_every_sample_once() -> None:
    first, second = run_distributed(_predicted, 2, timeout=120)
    assert sorted(first + second) == list(range(7)), "no padding: each sample once"
