"""Trainer arguments resolve to a strategy through the registry, or fail saying what to do."""

from __future__ import annotations

from typing import Any

import pytest

import accord
from accord.collectives import TorchCollective
from accord.errors import ConfigurationError
from accord.strategies import (
    DDPStrategy,
    DPStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)


def _trainer(**kwargs: Any) -> accord.Trainer:
    return accord.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize(
    ("name", "cls", "attrs"),
    [
        ("auto", SingleDeviceStrategy, {}),
        ("single_device", SingleDeviceStrategy, {}),
        ("ddp", DDPStrategy, {"start_method": "popen"}),
        ("ddp_spawn", DDPStrategy, {"start_method": "spawn"}),
        ("ddp_fork", DDPStrategy, {"start_method": "fork"}),
        ("ddp_notebook", DDPStrategy, {"start_method": "fork"}),
        ("DDP_Find_Unused_Parameters_True", DDPStrategy, {}),
        ("dp", DPStrategy, {}),
    ],
)
def test_names_resolve(name: str, cls: type, attrs: dict[str, Any]) -> None:
    devices = 1 if cls is SingleDeviceStrategy else 2
    strategy = _trainer(strategy=name, devices=devices).strategy
    assert type(strategy) is cls
    for key, value in attrs.items():
        assert getattr(strategy, key) == value


def test_auto_with_several_devices_is_ddp() -> None:
    strategy = _trainer(devices=4).strategy  # processes, not cores: 4 on 2 cores is fine
    assert isinstance(strategy, DDPStrategy)
    assert strategy.world_size == 4
    assert isinstance(strategy.collective, TorchCollective)
    assert strategy.collective.backend == "gloo"


def test_find_unused_parameters_is_passed_on() -> None:
    strategy = _trainer(strategy="ddp_find_unused_parameters_true", devices=2).strategy
    assert isinstance(strategy, DDPStrategy)
    assert strategy.ddp_kwargs["find_unused_parameters"] is True


def test_registering_a_user_strategy() -> None:
    class MyDDP(DDPStrategy):
        pass

    StrategyRegistry.register("my_ddp", MyDDP, description="mine", start_method="spawn")
    try:
        strategy = _trainer(strategy="my_ddp", devices=2).strategy
        assert isinstance(strategy, MyDDP) and strategy.start_method == "spawn"
        assert "my_ddp" in StrategyRegistry.available_strategies()
        with pytest.raises(ConfigurationError, match="already registered"):
            StrategyRegistry.register("my_ddp", MyDDP)
    finally:
        StrategyRegistry.remove("my_ddp")


def test_an_instance_is_used_as_given() -> None:
    given = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    trainer = _trainer(strategy=given, devices=3)
    assert trainer.strategy is given
    assert given.world_size == 3 and given.parallel_devices is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "dpp"}, r"Unknown strategy 'dpp'\. Did you mean 'ddp'\?"),
        ({"strategy": "ddp_spwan"}, r"Did you mean 'ddp_spawn'"),
        ({"strategy": 3}, r"registered name"),
        ({"devices": 0}, r"devices=0 asks for no devices"),
        ({"devices": "two"}, r"not understood"),
        ({"devices": [0, 0]}, r"distinct"),
        ({"num_nodes": 0}, r"num_nodes=0 must be an int >= 1"),
        ({"strategy": "dp", "num_nodes": 2}, r"one machine"),
        ({"strategy": "single_device", "devices": 2}, r"one device"),
        ({"precision": "16-mixed"}, r"needs a CUDA device"),
        ({"precision": "64"}, r"Unknown precision"),
        ({"max_epochs": -1}, r"max_epochs"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches"),
        ({"limit_train_batches": 1.5}, r"fraction outside"),
        ({"gradient_clip_val": 0}, r"gradient_clip_val"),
        ({"callbacks": [object()]}, r"Callback"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        _trainer(**kwargs)


@pytest.mark.parametrize(
    ("accelerator", "message"),
    [("cpuu", r"Did you mean 'cpu'"), ("gpu", r"no CUDA device"), ("cuda", r"no CUDA device")],
)
def test_bad_accelerators(accelerator: str, message: str) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigurationError, match=message):
        accord.Trainer(accelerator=accelerator, logger=False)


def test_fit_needs_an_accord_module() -> None:
    import torch

    with pytest.raises(ConfigurationError, match=r"accord\.Module"):
        _trainer().fit(torch.nn.Linear(2, 2), [])  # type: ignore[arg-type]
