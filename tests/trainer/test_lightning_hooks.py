"""Lightning's module and callback hooks as users override them: each takes effect, or is
refused with a message; a misspelled hook is named, with the closest real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accord
from accord.callbacks import Callback, EarlyStopping, ModelCheckpoint
from accord.errors import ConfigurationError
from accord.loggers import TensorBoardLogger
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, flat_weights, loader


def _trainer(tmp_path: Path, **kwargs: Any) -> accord.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return accord.Trainer(**options)


def test_a_misspelled_hook_is_named_with_the_closest_real_one(tmp_path: Path) -> None:
    class Typo(LinearModel):
        def on_validation_epoch_ends(self) -> None:
            pass

        def configure_optimizer(self) -> None:
            pass

    class TypoCallback(Callback):
        def on_train_batch_ended(self, *args: Any) -> None:
            pass

    with pytest.warns(UserWarning) as caught:
        _trainer(tmp_path, max_steps=1, callbacks=[TypoCallback()]).fit(Typo(), loader(8))
    messages = [str(w.message) for w in caught]
    assert any(
        "Typo.on_validation_epoch_ends()" in m and "'on_validation_epoch_end'" in m
        for m in messages
    )
    assert any(
        "Typo.configure_optimizer()" in m and "'configure_optimizers'" in m for m in messages
    )
    assert any(
        "TypoCallback.on_train_batch_ended()" in m and "'on_train_batch_end'" in m for m in messages
    )


def test_refused_hooks_are_refused_before_anything_runs(tmp_path: Path) -> None:
    class Sharded(LinearModel):
        def configure_sharded_model(self) -> None:
            pass

    with pytest.raises(ConfigurationError, match="rename the method to configure_model"):
        _trainer(tmp_path, max_steps=1).fit(Sharded(), loader(8))

    class OwnBackward(LinearModel):
        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            loss.backward()

    trainer = _trainer(tmp_path, strategy="deepspeed_stage_2", devices=2, max_steps=1)
    with pytest.raises(ConfigurationError, match=r"overrides backward\(\).*DeepSpeed"):
        trainer.fit(OwnBackward(), loader(8))


def test_on_train_batch_start_returning_minus_one_ends_the_epoch(tmp_path: Path) -> None:
    class Short(LinearModel):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return -1 if batch_idx == 3 else None

    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(Short(), loader(8))
    assert trainer.global_step == 6 and trainer.current_epoch == 2


def test_configure_callbacks_adds_and_replaces(tmp_path: Path) -> None:
    mine = EarlyStopping("train_loss", patience=100)

    class WithCallbacks(LinearModel):
        def configure_callbacks(self) -> Any:
            return [mine, ModelCheckpoint(dirpath=tmp_path / "mine")]

    given = EarlyStopping("train_loss")
    trainer = _trainer(tmp_path, max_steps=2, callbacks=[given])
    trainer.fit(WithCallbacks(), loader(8))
    assert given not in trainer.callbacks and mine in trainer.callbacks
    assert isinstance(trainer.callbacks[-1], ModelCheckpoint), "checkpoint callbacks last"


def test_optimizer_step_overrides_take_effect_and_must_run_the_closure(tmp_path: Path) -> None:
    class Frozen(LinearModel):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
            closure()  # computes gradients, never steps

    model = Frozen()
    before = flat_weights(model)
    _trainer(tmp_path, max_steps=3).fit(model, loader(8))
    assert torch.equal(flat_weights(model), before)

    class Forgetful(LinearModel):
        def optimizer_step(self, *args: Any) -> None:
            pass

    with pytest.raises(ConfigurationError, match="did not run the closure"):
        _trainer(tmp_path, max_steps=1).fit(Forgetful(), loader(8))


def test_lbfgs_gets_the_closure_it_needs(tmp_path: Path) -> None:
    class Lbfgs(LinearModel):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps += 1
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)

    model = Lbfgs()
    _trainer(tmp_path, max_steps=2).fit(model, loader(64))
    assert model.steps > 2, "LBFGS calls the closure several times a step"
    assert model.losses[-1] < model.losses[0]


def test_the_optimization_hooks_replace_the_loops_own_work(tmp_path: Path) -> None:
    calls: list[str] = []

    class Hooks(LinearModel):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            calls.append("zero_grad")
            optimizer.zero_grad(set_to_none=False)

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            calls.append("backward")
            (loss * 0).backward()

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            calls.append("scheduler")

        def configure_gradient_clipping(self, optimizer: Any, **kwargs: Any) -> None:
            calls.append(f"clip {kwargs['gradient_clip_val']} {kwargs['gradient_clip_algorithm']}")

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1)]

    model = Hooks()
    before = flat_weights(model)
    _trainer(tmp_path, max_steps=2, gradient_clip_val=3.0).fit(model, loader(8))
    # The backward override made zero gradients: nothing moved.
    assert torch.equal(flat_weights(model), before)
    assert calls == ["zero_grad", "backward", "clip 3.0 norm"] * 2
    assert "scheduler" not in calls, "an epoch-interval scheduler steps only at the epoch's end"


def test_the_transfer_hooks_of_the_datamodule_win_over_the_modules(tmp_path: Path) -> None:
    seen: list[str] = []

    class Mover(LinearModel):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("module before")
            return batch

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("module after")
            return batch

    class Data(accord.DataModule):
        def train_dataloader(self) -> Any:
            return loader(128)

        def transfer_batch_to_device(self, batch: Any, device: torch.device, index: int) -> Any:
            seen.append("datamodule transfer")
            return [t.to(device) for t in batch]

    model = Mover()
    _trainer(tmp_path, max_steps=1).fit(model, datamodule=Data())
    assert seen == ["module before", "datamodule transfer", "module after"]


def test_eval_mode_is_restored_per_submodule(tmp_path: Path) -> None:
    class PartlyFrozen(LinearModel):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(8)
            self.norm.eval()

    model = PartlyFrozen()
    with pytest.warns(UserWarning, match="in eval mode as training starts"):
        _trainer(tmp_path, max_epochs=1).fit(model, loader(64), loader(64))
    assert model.training and model.layer.training and not model.norm.training


def test_freeze_unfreeze_and_toggled_optimizer() -> None:
    model = LinearModel()
    model.freeze()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    model.unfreeze()
    assert model.training and all(p.requires_grad for p in model.parameters())


def test_configure_model_runs_before_the_strategy_wraps(tmp_path: Path) -> None:
    class Late(accord.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer: nn.Module | None = None

        def configure_model(self) -> None:
            if self.layer is None:
                self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert self.layer is not None
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Late()
    _trainer(tmp_path, max_steps=2).fit(model, loader(8))
    assert model.layer is not None


def test_checkpoint_hooks_of_module_and_callbacks(tmp_path: Path) -> None:
    class Saver(Callback):
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            checkpoint["extra"] = 42

        def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            module.loaded_extra = checkpoint["extra"]

    class Renamed(LinearModel):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            # Lightning calls it before the weights load, so it can adapt them.
            weights = checkpoint["state_dict"]
            weights["layer.weight"] = torch.zeros_like(weights["layer.weight"])

    path = tmp_path / "c.ckpt"

    class SaveAtEnd(Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            trainer.save_checkpoint(path)

    _trainer(tmp_path, max_steps=2, callbacks=[Saver(), SaveAtEnd()]).fit(Renamed(), loader(8))
    model = Renamed()
    _trainer(tmp_path, callbacks=[Saver()]).validate(
        model, loader(8), ckpt_path=path, verbose=False
    )
    assert model.loaded_extra == 42
    assert float(model.layer.weight.abs().sum()) == 0.0


def test_the_logger_and_its_experiment(tmp_path: Path) -> None:
    writers: list[Any] = []

    class Logs(LinearModel):
        def on_train_start(self) -> None:
            assert self.logger is self.loggers[0]
            writers.append(self.logger.experiment)

    logger = TensorBoardLogger(tmp_path)
    _trainer(tmp_path, max_steps=1, logger=logger).fit(Logs(), loader(8))
    from torch.utils.tensorboard import SummaryWriter

    assert isinstance(writers[0], SummaryWriter)


class _Gather(LinearModel):
    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        value = torch.tensor([float(self.global_rank + 1)], requires_grad=True)
        stacked = self.all_gather(value, sync_grads=True)
        self.gathered.append(stacked.detach().tolist())
        (stacked.sum() * (self.global_rank + 1)).backward()
        self.gathered.append(value.grad.tolist())
        nested = self.all_gather({"n": self.global_rank, "t": torch.ones(2)})
        self.gathered.append([nested["n"].tolist(), list(nested["t"].shape)])
        return super().training_step(batch, batch_idx)


def _gather(rank: int, world_size: int) -> list[Any]:
    model = _Gather()
    accord.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, loader(8))
    return model.gathered


def test_all_gather_stacks_every_ranks_data_through_the_strategy() -> None:
    for result in run_distributed(_gather, 2, timeout=120):
        stacked, grad, nested = result
        assert stacked == [[1.0], [2.0]]
        # d/dx_r of sum over ranks of (rank' + 1) * sum(stacked) = 1 + 2.
        assert grad == [3.0]
        assert nested == [[0, 1], [2, 2]]


def test_lightning_1_epoch_end_hooks_are_refused_with_the_way_forward(tmp_path: Path) -> None:
    class Old(LinearModel):
        def validation_epoch_end(self, outputs: Any) -> None:
            pass

    with pytest.raises(ConfigurationError, match="on_validation_epoch_end hook instead"):
        _trainer(tmp_path, max_steps=1).fit(Old(), loader(8), loader(8))


def test_a_validation_step_without_a_loader_says_no_validation_runs(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no validation loader"):
        _trainer(tmp_path, max_steps=1).fit(LinearModel(), loader(8))
