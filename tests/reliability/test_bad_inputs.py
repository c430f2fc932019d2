"""The bad-input catalogue: each mistake raises a specific exception whose message says
what was wrong and what to do — and none of them hangs."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import EarlyStopping, ModelCheckpoint
from accord.checkpoint import load_checkpoint_file, save_checkpoint_file
from accord.collectives import ReduceOp, SingleDeviceCollective, TorchCollective
from accord.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveNotSetupError,
    ConfigurationError,
)
from accord.strategies import DDPStrategy, StrategyRegistry
from tests.helpers.models import LinearModel, loader

pytestmark = pytest.mark.timeout(60)


def trainer(**kwargs: Any) -> accord.Trainer:
    base: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
    }
    return accord.Trainer(**{**base, **kwargs})


def collective() -> SingleDeviceCollective:
    return SingleDeviceCollective().setup()


class _Opaque:
    """Not one of the types torch.load(weights_only=True) accepts."""


def _fit(model: accord.Module, tmp: Path, ckpt_path: Any = None, **kwargs: Any) -> None:
    trainer(default_root_dir=tmp, max_epochs=1, **kwargs).fit(
        model, loader(64), loader(64), ckpt_path=ckpt_path
    )


class ReturnsText(LinearModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return "loss"


class NoOptimizer(LinearModel):
    def configure_optimizers(self) -> Any:
        return []


class WrongOptimizerType(LinearModel):
    def configure_optimizers(self) -> Any:
        return "sgd"


class Wider(LinearModel):
    def __init__(self) -> None:
        super().__init__(features=4)


def _corrupt(tmp: Path) -> Path:
    path = tmp / "corrupt.ckpt"
    path.write_bytes(b"\x00garbage" * 100)
    return path


def _truncated(tmp: Path) -> Path:
    path = tmp / "truncated.ckpt"
    save_checkpoint_file({"state_dict": LinearModel().state_dict()}, path)
    path.write_bytes(path.read_bytes()[:200])
    return path


def _not_a_dict(tmp: Path) -> Path:
    path = tmp / "list.ckpt"
    torch.save([1, 2, 3], path)
    return path


def _opaque(tmp: Path) -> Path:
    path = tmp / "opaque.ckpt"
    torch.save({"thing": _Opaque()}, path)
    return path


def _text_file(tmp: Path) -> Path:
    path = tmp / "notes.txt"
    path.write_text("epoch 3: loss 0.12\nthis is not a checkpoint\n")
    return path


def _plain_pickle(tmp: Path) -> Path:
    path = tmp / "plain.pkl"
    path.write_bytes(pickle.dumps({"state_dict": {}}, protocol=4))
    return path


def _empty(tmp: Path) -> Path:
    path = tmp / "empty.ckpt"
    path.touch()
    return path


def _other_model_checkpoint(tmp: Path) -> Path:
    path = tmp / "other.ckpt"
    save_checkpoint_file({"state_dict": Wider().state_dict(), "global_step": 0, "epoch": 0}, path)
    return path


Case = tuple[str, Callable[[Path], Any], type[BaseException], str]

CASES: list[Case] = [
    # strategy names
    ("strategy-typo", lambda t: trainer(strategy="dpp"), ConfigurationError, r"Did you mean 'ddp'"),
    (
        "strategy-transposed",
        lambda t: trainer(strategy="ddp_spwan"),
        ConfigurationError,
        r"Did you mean 'ddp_spawn'",
    ),
    (
        "strategy-unknown",
        lambda t: trainer(strategy="horovodd_x"),
        ConfigurationError,
        r"Registered strategies",
    ),
    ("strategy-empty", lambda t: trainer(strategy=""), ConfigurationError, r"Unknown strategy"),
    ("strategy-not-a-name", lambda t: trainer(strategy=3), ConfigurationError, r"registered name"),
    (
        "strategy-duplicate-register",
        lambda t: StrategyRegistry.register("ddp", DDPStrategy),
        ConfigurationError,
        r"already registered.*override=True",
    ),
    # accelerators
    (
        "accelerator-typo",
        lambda t: trainer(accelerator="cpuu"),
        ConfigurationError,
        r"Did you mean 'cpu'",
    ),
    (
        "accelerator-unknown",
        lambda t: trainer(accelerator="quantum"),
        ConfigurationError,
        r"Choose one of",
    ),
    (
        "accelerator-not-a-name",
        lambda t: trainer(accelerator=5),
        ConfigurationError,
        r"must be a name",
    ),
    # devices and nodes
    ("devices-zero", lambda t: trainer(devices=0), ConfigurationError, r"devices >= 1"),
    ("devices-negative", lambda t: trainer(devices=-2), ConfigurationError, r"devices >= 1"),
    ("devices-text", lambda t: trainer(devices="two"), ConfigurationError, r"Pass a count"),
    ("devices-duplicate", lambda t: trainer(devices=[0, 0]), ConfigurationError, r"distinct"),
    ("devices-negative-index", lambda t: trainer(devices=[-1]), ConfigurationError, r"distinct"),
    ("devices-bool", lambda t: trainer(devices=True), ConfigurationError, r"not a count"),
    ("num-nodes-zero", lambda t: trainer(num_nodes=0), ConfigurationError, r"int >= 1"),
    ("num-nodes-float", lambda t: trainer(num_nodes=1.5), ConfigurationError, r"int >= 1"),
    # strategy / accelerator / precision mismatches
    (
        "dp-many-nodes",
        lambda t: trainer(strategy="dp", num_nodes=2),
        ConfigurationError,
        r"strategy='ddp'",
    ),
    (
        "single-device-many",
        lambda t: trainer(strategy="single_device", devices=2),
        ConfigurationError,
        r"Use strategy='ddp'",
    ),
    ("fp16-on-cpu", lambda t: trainer(precision="16-mixed"), ConfigurationError, r"bf16-mixed"),
    ("precision-unknown", lambda t: trainer(precision="64"), ConfigurationError, r"Use one of"),
    (
        "precision-typo",
        lambda t: trainer(precision="bf16-mxed"),
        ConfigurationError,
        r"Did you mean 'bf16-mixed'",
    ),
    (
        "ddp-bad-start-method",
        lambda t: DDPStrategy(start_method="thread"),  # type: ignore[arg-type]
        ConfigurationError,
        r"popen",
    ),
    # trainer arguments
    ("max-epochs-negative", lambda t: trainer(max_epochs=-2), ConfigurationError, r">= 0"),
    ("max-steps-negative", lambda t: trainer(max_steps=-5), ConfigurationError, r"-1"),
    (
        "accumulate-zero",
        lambda t: trainer(accumulate_grad_batches=0),
        ConfigurationError,
        r"int >= 1",
    ),
    (
        "limit-fraction-too-big",
        lambda t: trainer(limit_train_batches=1.5),
        ConfigurationError,
        r"Pass an int",
    ),
    ("limit-negative", lambda t: trainer(limit_val_batches=-1), ConfigurationError, r">= 0"),
    ("clip-zero", lambda t: trainer(gradient_clip_val=0), ConfigurationError, r"> 0"),
    (
        "callback-wrong-type",
        lambda t: trainer(callbacks=[object()]),
        ConfigurationError,
        r"Callback objects",
    ),
    (
        "logger-wrong-type",
        lambda t: trainer(logger=["csv"]),
        ConfigurationError,
        r"must be a Logger",
    ),
    (
        "fit-not-a-module",
        lambda t: trainer().fit(torch.nn.Linear(2, 2), []),  # type: ignore[arg-type]
        ConfigurationError,
        r"Subclass accord\.Module",
    ),
    # the module's answers
    (
        "training-step-returns-text",
        lambda t: _fit(ReturnsText(), t),
        ConfigurationError,
        r"return the loss tensor",
    ),
    ("no-optimizer", lambda t: _fit(NoOptimizer(), t), ConfigurationError, r"no optimizer"),
    (
        "optimizer-wrong-type",
        lambda t: _fit(WrongOptimizerType(), t),
        ConfigurationError,
        r"Return an optimizer",
    ),
    (
        "early-stopping-unknown-metric",
        lambda t: _fit(LinearModel(), t, callbacks=[EarlyStopping("val_los")]),
        ConfigurationError,
        r"was not logged",
    ),
    (
        "early-stopping-bad-mode",
        lambda t: EarlyStopping("x", mode="avg"),
        ConfigurationError,
        r"'min' or 'max'",
    ),
    (
        "checkpoint-bad-top-k",
        lambda t: ModelCheckpoint(save_top_k=-2),
        ConfigurationError,
        r">= -1",
    ),
    (
        "checkpoint-filename-unknown-field",
        lambda t: _fit(LinearModel(), t, callbacks=[ModelCheckpoint(filename="{val_acc:.2f}")]),
        ConfigurationError,
        r"not logged",
    ),
    # collectives
    (
        "reduce-op-unknown",
        lambda t: collective().all_reduce(torch.ones(1), "median"),
        ValueError,
        r"Use one of",
    ),
    ("reduce-op-not-a-name", lambda t: ReduceOp.parse(42), ValueError, r"Unsupported reduce op"),
    (
        "all-reduce-non-tensor",
        lambda t: collective().all_reduce(3.0),  # type: ignore[arg-type]
        TypeError,
        r"torch\.tensor",
    ),
    (
        "broadcast-list",
        lambda t: collective().broadcast([1]),  # type: ignore[arg-type]
        TypeError,
        r"broadcast_object",
    ),
    (
        "all-gather-text",
        lambda t: collective().all_gather("x"),  # type: ignore[arg-type]
        TypeError,
        r"all_gather_object",
    ),
    (
        "broadcast-src-out-of-range",
        lambda t: collective().broadcast(torch.ones(1), src=1),
        ValueError,
        r"not a rank",
    ),
    (
        "object-src-negative",
        lambda t: collective().broadcast_object(1, src=-1),
        ValueError,
        r"not a rank",
    ),
    (
        "unpicklable-object",
        lambda t: collective().broadcast_object(lambda: None),
        TypeError,
        r"not picklable",
    ),
    (
        "out-wrong-shape",
        lambda t: collective().all_reduce(torch.ones(2), out=torch.empty(3)),
        ValueError,
        r"out= must have shape",
    ),
    (
        "scatter-wrong-shape",
        lambda t: collective().scatter(torch.ones(3)),
        ValueError,
        r"world_size=1",
    ),
    (
        "op-before-setup",
        lambda t: TorchCollective("gloo").barrier(),
        CollectiveNotSetupError,
        r"setup\(\) first",
    ),
    ("torch-backend-unknown", lambda t: TorchCollective("nccll"), ConfigurationError, r"gloo"),
    ("torch-timeout-negative", lambda t: TorchCollective(timeout=-1), ValueError, r"positive"),
    # checkpoints
    (
        "checkpoint-missing",
        lambda t: load_checkpoint_file(t / "nope.ckpt"),
        CheckpointError,
        r"No checkpoint",
    ),
    (
        "checkpoint-corrupt",
        lambda t: load_checkpoint_file(_corrupt(t)),
        CheckpointError,
        r"corrupt",
    ),
    (
        "checkpoint-truncated",
        lambda t: load_checkpoint_file(_truncated(t)),
        CheckpointError,
        r"truncated",
    ),
    (
        "checkpoint-not-a-dict",
        lambda t: load_checkpoint_file(_not_a_dict(t)),
        CheckpointError,
        r"not a checkpoint dict",
    ),
    (
        "checkpoint-unsafe-objects",
        lambda t: load_checkpoint_file(_opaque(t)),
        CheckpointError,
        r"refuses to unpickle: tests\.reliability\.test_bad_inputs\._Opaque\. .*weights_only=False",
    ),
    (
        "checkpoint-is-a-text-file",
        lambda t: _fit(LinearModel(), t, ckpt_path=_text_file(t)),
        CheckpointError,
        r"^(?!.*weights_only).*is not a checkpoint \(it holds text",
    ),
    (
        "checkpoint-is-a-plain-pickle",
        lambda t: load_checkpoint_file(_plain_pickle(t)),
        CheckpointError,
        r"^(?!.*weights_only).*not a checkpoint written by torch.save",
    ),
    (
        "checkpoint-empty-file",
        lambda t: load_checkpoint_file(_empty(t)),
        CheckpointError,
        r"is empty",
    ),
    (
        "checkpoint-from-another-model",
        lambda t: _fit(LinearModel(), t, ckpt_path=_other_model_checkpoint(t)),
        CheckpointError,
        r"different model",
    ),
    (
        "checkpoint-last-without-any",
        lambda t: _fit(LinearModel(), t, ckpt_path="last"),
        CheckpointError,
        r"no checkpoint in",
    ),
]


def test_the_catalogue_is_large() -> None:
    assert len(CASES) >= 40
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("case_id", "action", "error", "message"), CASES, ids=[case[0] for case in CASES]
)
def test_bad_input(
    case_id: str,
    action: Callable[[Path], Any],
    error: type[BaseException],
    message: str,
    tmp_path: Path,
) -> None:
    with pytest.raises(error, match=message):
        action(tmp_path)


def test_collective_errors_share_a_base() -> None:
    assert issubclass(CollectiveNotSetupError, CollectiveError)


def test_a_missing_optional_package_says_how_to_install() -> None:
    script = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from accord.loggers import TensorBoardLogger\n"
        "try:\n    TensorBoardLogger('.')\n"
        "except Exception as err:\n    print(type(err).__name__, err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.startswith("MissingDependencyError")
    assert "pip install 'accord[tensorboard]'" in result.stdout
