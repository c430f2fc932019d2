"""``torch.compile`` as Lightning users write it: a network compiled in ``__init__``, or
``trainer.fit(torch.compile(model))``. Real fits on one device, on 2 DDP ranks (started by
the test and by ``ddp_spawn``), under FSDP and DeepSpeed ZeRO-2; checkpoints hold the plain
parameter names and load into the compiled and the uncompiled model alike.

The compiler is ``aot_eager`` (the autograd graphs torch.compile builds, run without
generating code) or a backend that counts the graphs it is given: the default backend
compiles C++ on the CPU first, which takes a minute here.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import accord
from accord.callbacks import ModelCheckpoint
from accord.checkpoint import describe_checkpoint, read_checkpoint
from accord.checkpoint.compiled_names import module_names, plain_names
from accord.errors import ConfigurationError
from accord.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from accord.testing import run_distributed
from accord.trainer.compile import CompiledMethod, to_uncompiled
from tests.helpers.models import loader, regression_data

# aot_eager runs the same float32 kernels as eager; DDP, FSDP and ZeRO-2 differ only in the
# order of a few sums. A wrong or missing weight, or a lost optimizer state, moves the
# weights by far more.
RTOL, ATOL = 1e-5, 1e-6
PLAIN = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]

_graphs: list[int] = []


def _compile(model: nn.Module, backend: Any = "aot_eager") -> Any:
    """``torch.compile(model, backend=backend)``; torch types the result as a plain callable."""
    return torch.compile(model, backend=backend)


def counting_backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
    """A torch.compile backend that records each graph it is given and runs it as it is."""
    _graphs.append(len(graph.graph.nodes))
    return graph.forward


class Net(accord.Module):
    """Two linear layers trained with SGD + momentum (an optimizer state to restore); with
    ``compiled``, the network is compiled in ``__init__`` as Lightning users write it."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        if compiled:
            self.net = _compile(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out.squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self(batch[0])
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights under plain names (gathers FSDP's shards; collective)."""
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in plain_names(model.state_dict()).items()
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=RTOL, atol=ATOL)


def _trainer(strategy: Any, root: Path | None = None, **kwargs: Any) -> accord.Trainer:
    """A CPU Trainer on 2 ranks (1 for ``single_device``); with ``root``, every epoch's
    checkpoint is kept there."""
    callbacks = [ModelCheckpoint(dirpath=root, save_top_k=-1)] if root is not None else []
    settings: dict[str, Any] = {
        "devices": 1 if strategy == "single_device" else 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": root is not None,
        "callbacks": callbacks,
        "max_epochs": 2,
        **kwargs,
    }
    return accord.Trainer(strategy=strategy, **settings)


# ---------------------------------------------------------------- DDP, 2 ranks (one launch)
def _ddp_fits(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """Uncompiled, compiled in ``__init__``, each resumed from the other's first epoch, and
    ``torch.compile(model)`` whole; every run two epochs on the same data."""
    results: dict[str, Any] = {}
    for key, compiled in (("plain", False), ("compiled", True)):
        model = Net(compiled=compiled)
        _trainer("ddp", root / key).fit(model, loader(batch_size=16))
        results[key] = _weights(model)
    for key, compiled, source in (
        ("compiled_from_plain", True, "plain"),
        ("plain_from_compiled", False, "compiled"),
    ):
        model = Net(compiled=compiled)
        first_epoch = root / source / "epoch=0-step=8.ckpt"
        _trainer("ddp").fit(model, loader(batch_size=16), ckpt_path=first_epoch)
        results[key] = _weights(model)
    whole = Net()
    before = _weights(whole)
    _trainer("ddp").fit(_compile(whole), loader(batch_size=16))
    results["whole"] = _weights(whole)
    results["whole_changed"] = any(not torch.equal(before[k], results["whole"][k]) for k in before)
    results["whole_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return results


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("compile_ddp")
    return root, run_distributed(_ddp_fits, 2, root, timeout=240)


def test_compiled_in_init_trains_as_uncompiled_under_ddp(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = ddp_runs
    for rank in ranks:
        _assert_same(rank["compiled"], rank["plain"])
        # The weights moved: a run that trained nothing would match itself too.
        assert not torch.equal(rank["plain"]["net.0.weight"], Net().state_dict()["net.0.weight"])


def test_checkpoints_hold_plain_names_and_load_into_either_model(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, ranks = ddp_runs
    last = root / "compiled" / "epoch=1-step=16.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert list(checkpoint["state_dict"]) == PLAIN
    loaded = Net.load_from_checkpoint(last, compiled=False)
    _assert_same(_weights(loaded), ranks[0]["compiled"])
    into_compiled = Net.load_from_checkpoint(root / "plain" / "epoch=1-step=16.ckpt", compiled=True)
    assert next(iter(into_compiled.state_dict())) == "net._orig_mod.0.weight"
    _assert_same(_weights(into_compiled), ranks[0]["plain"])
    # The checkpoint CLI reads the same names.
    assert list(describe_checkpoint(last)["tensors"]) == PLAIN


def test_a_checkpoint_resumes_into_the_compiled_model_and_back(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = ddp_runs
    for rank in ranks:
        # Weights and the optimizer's momentum were restored: the uninterrupted result.
        _assert_same(rank["compiled_from_plain"], rank["plain"])
        _assert_same(rank["plain_from_compiled"], rank["plain"])


def test_fit_of_a_compiled_module_trains_it_under_ddp(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = ddp_runs
    for rank in ranks:
        assert rank["whole_changed"]
        assert rank["whole_graphs"] > 0  # the compiled code ran
        _assert_same(rank["whole"], rank["plain"])


def test_ddp_spawn_brings_the_trained_weights_into_the_callers_model(
    ddp_runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, ranks = ddp_runs
    model = Net()
    compiled = _compile(model)
    _trainer("ddp_spawn", tmp_path).fit(compiled, loader(batch_size=16))
    _assert_same(_weights(model), ranks[0]["plain"])
    assert list(torch.load(tmp_path / "epoch=1-step=16.ckpt")["state_dict"]) == PLAIN


def test_evaluation_loads_plain_checkpoints_into_compiled_models(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = ddp_runs
    last = root / "compiled" / "epoch=1-step=16.ckpt"
    trainer = _trainer("single_device")
    data = loader(batch_size=64)
    expected = trainer.validate(Net(), data, ckpt_path=last)
    assert trainer.validate(Net(compiled=True), data, ckpt_path=last) == expected
    whole = _compile(Net())
    test = trainer.test(whole, data, ckpt_path=root / "plain" / "epoch=1-step=16.ckpt")
    assert test[0]["test_loss"] == pytest.approx(expected[0]["val_loss"], rel=1e-5)
    predictions = trainer.predict(Net(compiled=True), data, ckpt_path=last)
    reference = Net.load_from_checkpoint(last)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.cat(predictions), reference(regression_data(256).tensors[0])
        )


# ------------------------------------------------------------------------- one device
def test_fit_of_a_compiled_module_runs_the_compiled_code(tmp_path: Path) -> None:
    _graphs.clear()
    model, reference = Net(), Net()
    compiled = _compile(model, counting_backend)
    _trainer("single_device", tmp_path, max_epochs=1).fit(compiled, loader(batch_size=32))
    _trainer("single_device", max_epochs=1).fit(reference, loader(batch_size=32))
    assert _graphs, "the compiled training step never ran"
    _assert_same(_weights(model), _weights(reference))
    assert list(torch.load(tmp_path / "epoch=0-step=8.ckpt")["state_dict"]) == PLAIN
    # As in Lightning, the module keeps running its compiled methods until they are taken off.
    assert isinstance(model.__dict__["training_step"], CompiledMethod)
    assert to_uncompiled(compiled) is model and "training_step" not in model.__dict__


def test_what_cannot_run_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigurationError, match=r"got torch.compile\(\) of a Linear"):
        _trainer("single_device").fit(_compile(nn.Linear(8, 1)), loader(batch_size=32))
    dp = accord.Trainer(strategy="dp", accelerator="cpu", logger=False)
    with pytest.raises(ConfigurationError, match="DPStrategy cannot train a torch"):
        dp.fit(_compile(Net()), loader(batch_size=32))
    with pytest.raises(ConfigurationError, match="it compiles 'net'"):
        dp.validate(Net(compiled=True), loader(batch_size=32))


def test_names_are_mapped_with_the_version_records() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3))
    compiled = nn.Sequential(_compile(nn.BatchNorm1d(3)))
    plain = plain_names(compiled.state_dict())
    assert list(plain) == list(model.state_dict())
    assert plain._metadata["0"] == model.state_dict()._metadata["0"]  # type: ignore[attr-defined]
    back = module_names(compiled, model.state_dict())
    assert list(back) == list(compiled.state_dict())
    compiled.load_state_dict(back)
    # Unknown names stay as they are, so a strict load still names them.
    assert list(module_names(compiled, OrderedDict(other=torch.zeros(1)))) == ["other"]
    state = model.state_dict()
    assert plain_names(state) is state and module_names(model, state) is state


# ------------------------------------------------------ FSDP and ZeRO-2, 2 ranks (one launch)
def _sharding(kind: str) -> Strategy:
    """FSDP with each Linear a unit of its own, or DeepSpeed ZeRO-2."""
    if kind == "fsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Linear})
    return DeepSpeedStrategy(stage=2)


def _sharded_fits(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """Under FSDP (sharded checkpoints, each Linear a unit) and DeepSpeed ZeRO-2: compiled in
    ``__init__`` for an epoch, then resumed as ``torch.compile(model)`` whole."""
    # The test owns the group, so FSDP's sharded weights can be gathered after each fit.
    dist.init_process_group("gloo")
    try:
        results: dict[str, Any] = {}
        for key in ("fsdp", "deepspeed"):
            _trainer(_sharding(key), root / key, max_epochs=1).fit(
                Net(compiled=True), loader(batch_size=16)
            )
            resumed = Net()
            _trainer(_sharding(key)).fit(
                _compile(resumed),
                loader(batch_size=16),
                ckpt_path=root / key / "epoch=0-step=8.ckpt",
            )
            results[key] = _weights(resumed)
        return results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("compile_sharded")
    return root, run_distributed(_sharded_fits, 2, root, timeout=300)


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_sharded_strategies_train_compiled_models_and_save_plain_names(
    ddp_runs: tuple[Path, list[dict[str, Any]]],
    sharded_runs: tuple[Path, list[dict[str, Any]]],
    kind: str,
) -> None:
    root, ranks = sharded_runs
    directory = root / kind / "epoch=0-step=8.ckpt"
    assert directory.is_dir()
    assert list(read_checkpoint(directory)["state_dict"]) == PLAIN
    assert list(describe_checkpoint(directory)["tensors"]) == PLAIN
    Net.load_from_checkpoint(directory, compiled=True)
    for rank in ranks:
        _assert_same(rank[kind], ddp_runs[1][0]["plain"])


def test_zero3_refuses_compiled_models() -> None:
    pytest.importorskip("deepspeed")
    trainer = _trainer(DeepSpeedStrategy(stage=3))
    with pytest.raises(ConfigurationError, match=r"DeepSpeedStrategy cannot train.*ZeRO-3"):
        trainer.fit(_compile(Net()), loader(batch_size=16))
    with pytest.raises(ConfigurationError, match="it compiles 'net'"):
        trainer.fit(Net(compiled=True), loader(batch_size=16))
