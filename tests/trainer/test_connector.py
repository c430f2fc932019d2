"""Trainer arguments resolve to a strategy through the registry, or fail saying what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import accord
from accord.collectives import TorchCollective
from accord.core.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT, rendezvous_timeout
from accord.environments.local import find_free_port
from accord.errors import CollectiveTimeoutError, ConfigurationError
from accord.precision import PrecisionMode
from accord.strategies import (
    DDPStrategy,
    DPStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from accord.testing import run_distributed
from tests.helpers.processes import ROOT


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
        ({"max_epochs": -2}, r"max_epochs"),
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


@pytest.mark.parametrize(
    ("precision", "mode"),
    [
        ("32-true", PrecisionMode.TRUE_32),
        (32, PrecisionMode.TRUE_32),
        ("bf16-mixed", PrecisionMode.BF16_MIXED),
        ("bf16", PrecisionMode.BF16_MIXED),
        ("bf16-true", PrecisionMode.BF16_TRUE),
        ("16-true", PrecisionMode.FP16_TRUE),
    ],
)
def test_precisions_that_run_on_cpu(precision: str | int, mode: PrecisionMode) -> None:
    for strategy in ("single_device", "dp"):
        assert _trainer(strategy=strategy, precision=precision).strategy.precision.mode is mode
    assert _trainer(strategy="ddp", devices=2, precision=precision).strategy.precision.mode is mode


@pytest.mark.parametrize("strategy", ["single_device", "dp", "ddp", "fsdp", "deepspeed"])
def test_16_mixed_on_cpu_says_what_works_instead(strategy: str) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    with pytest.raises(ConfigurationError, match=r"needs a CUDA device.*'bf16-mixed'"):
        _trainer(strategy=strategy, devices=2 if strategy != "single_device" else 1, precision=16)


# ------------------------------------------------------------ several machines
FIT = Path(__file__).resolve().parents[1] / "strategies" / "scripts" / "fit.py"
# Variables that would tell the script where it sits in a job; the tests set their own.
_JOB_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCORD_RENDEZVOUS_TIMEOUT",
)


def _run_node(
    tmp_path: Path, devices: int, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``fit.py`` as one node of a 2-node ddp job, as ``python fit.py`` in a shell would."""
    child_env = {
        key: value
        for key, value in os.environ.items()
        if key not in _JOB_VARIABLES and not key.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    # Without the fix this run waits forever; the timeout turns a regression into a failure.
    return subprocess.run(
        [sys.executable, str(FIT), str(tmp_path), "ddp", str(devices), "2"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**child_env, **env},
        cwd=ROOT,
        check=False,
    )


def test_two_nodes_without_a_rendezvous_fail_at_once_and_say_how_to_start(
    tmp_path: Path,
) -> None:
    result = _run_node(tmp_path, devices=2, env={}, timeout=60)
    assert result.returncode != 0
    assert "ConfigurationError" in result.stderr
    message = result.stderr[result.stderr.index("ConfigurationError") :]
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        assert name in message
    assert "NODE_RANK=1 python" in message and str(FIT.name) in message
    assert "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2" in message
    assert not list(tmp_path.iterdir())  # no rank trained


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "NODE_RANK"),
        ({"NODE_RANK": "1", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
        ({"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}, "MASTER_PORT"),
    ],
)
def test_each_missing_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], missing: str
) -> None:
    for name in _JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=rf"{missing} is not set") as info:
        _trainer(strategy="ddp", devices=2, num_nodes=2)
    # What is set already appears in the command for the other node as it is.
    for name, value in env.items():
        if name != "NODE_RANK":
            assert f"{name}={value}" in str(info.value)


def test_a_node_rank_outside_the_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NODE_RANK", "2")
    with pytest.raises(ConfigurationError, match=r"NODE_RANK=2.*num_nodes=2.*0 or 1"):
        _trainer(strategy="ddp", devices=2, num_nodes=2)


def _rendezvous_env(node_rank: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(find_free_port()),
        "NODE_RANK": str(node_rank),
        "ACCORD_RENDEZVOUS_TIMEOUT": "3",
    }


def test_node_zero_alone_gives_up_and_names_the_ranks_that_did_not_come(
    tmp_path: Path,
) -> None:
    # One process per node, so no local rank of this node can be late at the rendezvous.
    env = _rendezvous_env(node_rank=0)
    result = _run_node(tmp_path, devices=1, env=env)
    assert result.returncode != 0
    address = f"127.0.0.1:{env['MASTER_PORT']}"
    assert f"rendezvous at {address}" in result.stderr, result.stderr[-3000:]
    assert "rank 1 of 2 did not arrive within 3 s" in result.stderr
    assert "ACCORD_RENDEZVOUS_TIMEOUT" in result.stderr
    assert not list(tmp_path.iterdir())


def test_a_node_that_cannot_reach_node_zero_gives_up_and_names_the_address(
    tmp_path: Path,
) -> None:
    env = _rendezvous_env(node_rank=1)
    result = _run_node(tmp_path, devices=1, env=env)
    assert result.returncode != 0
    address = f"127.0.0.1:{env['MASTER_PORT']}"
    assert f"could not reach the rendezvous at {address} within 3 s" in result.stderr, (
        result.stderr[-3000:]
    )
    assert "node 0" in result.stderr


def _join_a_group_of_four(rank: int, world_size: int, ready: Path) -> dict[str, Any]:
    # Both real ranks start the rendezvous together, however long the other took to start.
    (ready / str(rank)).touch()
    while len(list(ready.iterdir())) < world_size:
        time.sleep(0.05)
    try:
        TorchCollective("gloo").setup(rank=rank, world_size=4)
    except CollectiveTimeoutError as err:
        return {"missing": err.missing_ranks, "op": err.op, "message": str(err)}
    return {"missing": None}


def test_the_rendezvous_names_every_missing_rank_on_every_rank(tmp_path: Path) -> None:
    # Two real ranks of a group of four: ranks 2 and 3 never come.
    results = run_distributed(
        _join_a_group_of_four,
        2,
        tmp_path,
        env={"ACCORD_RENDEZVOUS_TIMEOUT": "10"},
        timeout=120,
    )
    for rank, result in enumerate(results):
        assert result["missing"] == [2, 3]
        assert result["op"] == "rendezvous"
        assert f"Rank {rank} gave up waiting" in result["message"]
        assert "ranks 2, 3 of 4 did not arrive within 10 s" in result["message"]


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_rendezvous_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ACCORD_RENDEZVOUS_TIMEOUT", value)
    with pytest.raises(ConfigurationError, match="ACCORD_RENDEZVOUS_TIMEOUT"):
        rendezvous_timeout()
    monkeypatch.setenv("ACCORD_RENDEZVOUS_TIMEOUT", "2.5")
    assert rendezvous_timeout().total_seconds() == 2.5
    monkeypatch.delenv("ACCORD_RENDEZVOUS_TIMEOUT")
    assert rendezvous_timeout() == DEFAULT_RENDEZVOUS_TIMEOUT


def test_a_strategy_instance_keeps_its_own_precision() -> None:
    from accord.precision import Precision
    from accord.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(precision=Precision("bf16-mixed"))
    trainer = accord.Trainer(strategy=strategy, accelerator="cpu", logger=False)
    assert trainer.strategy.precision.mode is PrecisionMode.BF16_MIXED
    # Both set and the same: fine; both set and different: say so, do not pick one.
    same = SingleDeviceStrategy(precision=Precision("bf16-mixed"))
    accord.Trainer(strategy=same, precision="bf16-mixed", accelerator="cpu", logger=False)
    other = SingleDeviceStrategy(precision=Precision("bf16-mixed"))
    with pytest.raises(ConfigurationError, match=r"built with precision 'bf16-mixed'.*'32-true'"):
        accord.Trainer(strategy=other, precision="32-true", accelerator="cpu", logger=False)
    # A strategy without a Precision of its own follows the Trainer.
    plain = SingleDeviceStrategy()
    trained = accord.Trainer(strategy=plain, precision="bf16-true", accelerator="cpu", logger=False)
    assert trained.strategy.precision.mode is PrecisionMode.BF16_TRUE
