"""assert_strategies_agree: the public equivalence kit, on real strategies and processes."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import accord
from accord.collectives import ReduceOpLike, TorchCollective
from accord.errors import ConfigurationError, RankFailureError
from accord.strategies import DDPStrategy
from accord.testing import DEFAULT_TOLERANCES, assert_strategies_agree
from accord.testing._agree_launch import _launch


class Net(accord.Module):
    """Two layers, SGD with momentum (so the optimizer has state)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=generator)
    return TensorDataset(x, x.sum(-1) + 0.1 * torch.randn(32, generator=generator))


class DropsRankOne(TorchCollective):
    """Zeroes rank 1's share of every gradient bucket: DDP then averages half the gradients."""

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is tensor and self.rank == 1:
            tensor.zero_()
        return super().all_reduce(tensor, op, out=out)


class LossyDDP(DDPStrategy):
    """A DDP whose collective carries the gradients and loses rank 1's."""

    def __init__(self) -> None:
        super().__init__(gradient_sync="collective")

    def default_collective(self) -> TorchCollective:
        return DropsRankOne()


def test_ddp_fsdp_and_dp_agree_with_one_device() -> None:
    records = assert_strategies_agree(Net, make_data, ["ddp", "fsdp", "dp"], steps=4)
    assert list(records) == ["single_device", "ddp", "fsdp", "dp"]
    reference = records["single_device"]
    assert len(reference.losses) == 4
    assert reference.samples == [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    # The loss falls: the runs trained.
    assert reference.losses[-1] < reference.losses[0]
    assert records["ddp"].samples == reference.samples
    assert set(records["fsdp"].weights) == set(reference.weights)


def test_deepspeed_stage_2_agrees_with_one_device() -> None:
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    assert_strategies_agree(Net, make_data, ["deepspeed_stage_2"], steps=3, timeout=400)


def test_a_strategy_that_drops_gradients_is_named_with_step_and_parameter() -> None:
    with pytest.raises(AssertionError) as err:
        assert_strategies_agree(Net, make_data, [LossyDDP], steps=3)
    message = str(err.value)
    assert message.startswith("LossyDDP does not train as single_device does")
    # Step 0's loss is computed before any update; step 1 shows the lost gradients.
    assert "the loss of step 1 differs" in message
    assert "the update of step 0 already differed" in message
    assert "the first parameter that parts is 'net.0.weight'" in message


def test_settings_that_cannot_agree_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="multiple of devices=3"):
        assert_strategies_agree(Net, make_data, ["ddp"], batch_size=8, devices=3)
    with pytest.raises(ConfigurationError, match="at least steps \\* batch_size = 40"):
        assert_strategies_agree(Net, make_data, ["ddp"], steps=5)
    assert DEFAULT_TOLERANCES[torch.float32] == (1e-5, 1e-6)


def test_ddp_spawn_and_ddp_fork_agree_with_one_device() -> None:
    # Their own launcher starts the ranks from this process; the kit reads each rank's record.
    records = assert_strategies_agree(Net, make_data, ["ddp_spawn", "ddp_fork"], steps=2)
    assert list(records) == ["single_device", "ddp_spawn", "ddp_fork"]
    assert records["ddp_fork"].samples == [list(range(8)), list(range(8, 16))]


def test_the_other_registered_ddp_and_fsdp_variants_agree_with_one_device() -> None:
    names = [
        "ddp_find_unused_parameters_true",
        "ddp_spawn_find_unused_parameters_true",
        "ddp_notebook",
        "fsdp_cpu_offload",
    ]
    records = assert_strategies_agree(Net, make_data, names, steps=2)
    assert list(records) == ["single_device", *names]


def test_deepspeed_stages_1_and_3_agree_with_one_device() -> None:
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    assert_strategies_agree(
        Net, make_data, ["deepspeed_stage_1", "deepspeed_stage_3"], steps=2, timeout=400
    )


def test_deepspeed_and_its_offload_variants_agree_with_one_device() -> None:
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    names = ["deepspeed", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"]
    records = assert_strategies_agree(Net, make_data, names, steps=2, timeout=400)
    assert list(records) == ["single_device", *names]


class TorchrunDDP(DDPStrategy):
    """A DDP whose ranks an outside launcher (torchrun) must start, as horovodrun does Horovod's."""

    def external_launch_command(self, num_processes: int) -> list[str] | None:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={num_processes}",
            "--no-python",
        ]


def test_each_strategy_starts_its_ranks_the_way_it_must() -> None:
    assert _launch("single_device", 2) == ("caller", 1, None)
    assert _launch("dp", 2) == ("caller", 1, None)
    # Ranks that find themselves already started: run_distributed starts them.
    assert _launch("ddp", 2) == ("ranks", 2, None)
    assert _launch("fsdp", 2) == ("ranks", 2, None)
    # Their own launcher would start ranks again inside run_distributed's: run in the caller.
    assert _launch("ddp_spawn", 2) == ("launcher", 2, None)
    assert _launch("ddp_fork", 2) == ("launcher", 2, None)
    launch, ranks, command = _launch(TorchrunDDP, 2)
    assert (launch, ranks) == ("external", 2)
    assert command is not None and "--nproc-per-node=2" in command


def test_a_strategy_started_by_an_outside_launcher_agrees_with_one_device() -> None:
    # The kit runs accord.testing._agree_worker under the launcher, the arguments pickled.
    records = assert_strategies_agree(Net, make_data, [TorchrunDDP], steps=2)
    assert records["TorchrunDDP"].samples == records["single_device"].samples


class LauncherFails(DDPStrategy):
    """A strategy whose outside launcher exits with code 3 before any rank starts."""

    def external_launch_command(self, num_processes: int) -> list[str] | None:
        return [sys.executable, "-c", "print('no ranks today'); raise SystemExit(3)"]


class LauncherHangs(DDPStrategy):
    """A strategy whose outside launcher never finishes."""

    def external_launch_command(self, num_processes: int) -> list[str] | None:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_an_outside_launcher_that_fails_or_hangs_is_reported() -> None:
    with pytest.raises(RankFailureError, match="failed with exit code 3:") as err:
        assert_strategies_agree(Net, make_data, [LauncherFails], steps=1)
    assert "no ranks today" in str(err.value)  # the launcher's output comes with it
    with pytest.raises(RankFailureError, match="did not finish within 2 s; it was stopped"):
        assert_strategies_agree(Net, make_data, [LauncherHangs], steps=1, timeout=2)
