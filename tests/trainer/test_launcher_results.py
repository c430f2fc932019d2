"""A launcher whose ranks are other processes hands rank zero's results back through its
public contract: `launch` returns what the work returned, and the Trainer applies it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

import accord
from accord.callbacks import Callback
from accord.environments import LocalEnvironment
from accord.launchers import Launcher, MultiprocessingLauncher, SubprocessScriptLauncher
from accord.strategies import SingleDeviceStrategy
from tests.helpers.models import LinearModel, flat_weights, loader


class CopyingLauncher(Launcher):
    """Runs the work on a pickled copy of everything, as a spawned rank would."""

    @property
    def runs_in_caller(self) -> bool:
        return False

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        fn, args, kwargs = pickle.loads(pickle.dumps((fn, args, kwargs)))
        return fn(*args, **kwargs)


class CopyingStrategy(SingleDeviceStrategy):
    @property
    def launcher(self) -> Launcher:
        return CopyingLauncher()


class CountEpochs(Callback):
    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_end(self, trainer: accord.Trainer, module: accord.Module) -> None:
        self.epochs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = state["epochs"]


def _trainer(strategy: Any, callback: Callback) -> accord.Trainer:
    return accord.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


def test_results_of_ranks_in_other_processes_come_home() -> None:
    reference = LinearModel()
    _trainer("single_device", CountEpochs()).fit(reference, loader(32))

    model, counter = LinearModel(), CountEpochs()
    before = flat_weights(model)
    trainer = _trainer(CopyingStrategy(), counter)
    trainer.fit(model, loader(32))
    # The work trained copies; what comes back is rank zero's state.
    assert not torch.equal(flat_weights(model), before)
    torch.testing.assert_close(flat_weights(model), flat_weights(reference), rtol=0, atol=0)
    assert trainer.global_step == 2 * 256 // 32
    assert trainer.current_epoch == 2
    assert counter.epochs == 2
    assert "train_loss_epoch" in trainer.callback_metrics
    assert "train_loss_epoch" in trainer.logged_metrics

    # What the run returns comes back as the stage's result.
    metrics = trainer.validate(model, loader(64))
    assert list(metrics[0]) == ["val_loss"]
    assert float(trainer.callback_metrics["val_loss"]) == metrics[0]["val_loss"]
    predictions = trainer.predict(model, loader(64))
    assert len(predictions) == 4
    torch.testing.assert_close(torch.cat(predictions), model(loader(256).dataset.tensors[0]))


def test_each_launcher_says_whether_the_caller_is_a_rank() -> None:
    env = LocalEnvironment()
    assert SubprocessScriptLauncher(env, 2).runs_in_caller
    assert not MultiprocessingLauncher(env, 2, "spawn").runs_in_caller
    assert CopyingLauncher().runs_in_caller is False
