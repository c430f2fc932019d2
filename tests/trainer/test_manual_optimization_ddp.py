"""Manual optimization (automatic_optimization = False) on DDP, in real processes over gloo:
a two-optimizer GAN-style module and gradient accumulation by hand train as on one device
fed the same global batches; strategies that cannot run it say so before any process
starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.errors import ConfigurationError
from accord.module import StrategyOptimizer
from accord.strategies import DDPStrategy
from accord.testing import run_distributed

# 32 samples: 4 batches of 4 per rank on two ranks, or 4 batches of 8 on one device.
_SAMPLES = 32


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    real = torch.randn(_SAMPLES, 4, generator=generator)
    # The noise travels with the sample, so a rank's share of a global batch holds the
    # same noise as that batch on one device.
    noise = torch.randn(_SAMPLES, 2, generator=generator)
    return TensorDataset(real, noise)


class GAN(accord.Module):
    """Alternating discriminator and generator steps, each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Linear(2, 4)
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        self.toggle_optimizer(d_opt)
        fake = self.generator(noise)
        d_loss = (
            nn.functional.softplus(-self.discriminator(real)).mean()
            + nn.functional.softplus(self.discriminator(fake.detach())).mean()
        )
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, 0.5)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = nn.functional.softplus(-self.discriminator(self.generator(noise))).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.lr_schedulers().step()  # type: ignore[union-attr]
        self.log("d_loss", d_loss)

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        return [g_opt, d_opt], [torch.optim.lr_scheduler.StepLR(g_opt, 1, gamma=0.9)]


class Accumulating(accord.Module):
    """One optimizer stepped every ``every`` batches; the other batches' backward passes
    run under ``toggle_model(sync_grad=False)``."""

    def __init__(self, every: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.every = every
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        # Per batch: whether every rank held the same gradient after its backward.
        self.grads_agree: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt = self.optimizers()
        assert isinstance(opt, StrategyOptimizer)
        stepping = (batch_idx + 1) % self.every == 0
        with opt.toggle_model(sync_grad=stepping):
            loss = nn.functional.mse_loss(self.net(real), noise) / self.every
            self.manual_backward(loss)
        grad = self.net.weight.grad
        assert grad is not None
        gathered = self.trainer.strategy.all_gather(grad.detach().clone().unsqueeze(0))
        self.grads_agree.append(all(torch.equal(g, gathered[0]) for g in gathered))
        if stepping:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


class TwoStepsPerBatch(accord.Module):
    """Two backward passes and optimizer steps in one ``training_step``, each over every
    parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt = self.optimizers()
        assert isinstance(opt, StrategyOptimizer)
        for scale in (1.0, 2.0):
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.net(real) * scale, noise))
            opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


_KINDS = {"gan": GAN, "accumulate": Accumulating, "two_steps": TwoStepsPerBatch}


def _trainer(root: Path | None, **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": root,
        **kwargs,
    }
    return accord.Trainer(**settings)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_device(model: accord.Module, root: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The same module on one device, fed each global batch (both ranks' shares) whole."""
    trainer = _trainer(root, strategy="single_device", devices=1)
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    return _weights(model), trainer.global_step


def _fit_on_ddp(
    rank: int, world_size: int, root: Path, kind: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    model = _KINDS[kind]()
    strategy = DDPStrategy(**(options or {}))
    trainer = _trainer(root, strategy=strategy, devices=world_size)
    trainer.fit(model, DataLoader(_data(), batch_size=4))
    return {
        "weights": _weights(model),
        "global_step": trainer.global_step,
        "grads_agree": getattr(model, "grads_agree", None),
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in actual.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_two_optimizers_on_ddp_train_as_one_device(tmp_path: Path) -> None:
    ranks = run_distributed(_fit_on_ddp, 2, tmp_path, "gan", timeout=240)
    expected, steps = _one_device(GAN(), tmp_path)
    # Two optimizer steps per batch, 4 batches per epoch, 2 epochs.
    assert steps == 16
    assert [r["global_step"] for r in ranks] == [16, 16]
    # The ranks see different halves of each batch: only averaged gradients keep them equal.
    for key, value in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[1]["weights"][key], value, rtol=0, atol=0, msg=key)
    _assert_same(ranks[0]["weights"], expected)
    # The discriminator's frozen generator and vice versa: both moved.
    start = GAN().state_dict()
    for key in ("generator.weight", "discriminator.0.weight"):
        assert not torch.equal(ranks[0]["weights"][key], start[key]), key


@pytest.mark.parametrize("options", [{"gradient_sync": "collective"}, {"debug": True}])
def test_gradients_through_the_collective(options: dict[str, Any], tmp_path: Path) -> None:
    # Every gradient bucket goes through the strategy's collective (a DDP comm hook); in
    # debug mode through the check that the ranks make the same calls.
    ranks = run_distributed(_fit_on_ddp, 2, tmp_path, "gan", options, timeout=240)
    expected, _ = _one_device(GAN(), tmp_path)
    _assert_same(ranks[0]["weights"], expected)
    _assert_same(ranks[1]["weights"], expected)


# None: on under manual optimization; False: DDP's reducer also rebuilds its buckets.
@pytest.mark.parametrize("find_unused", [None, False])
def test_accumulation_by_hand_skips_the_sync_between_steps(
    find_unused: bool | None, tmp_path: Path
) -> None:
    options = {"find_unused_parameters": find_unused}
    ranks = run_distributed(_fit_on_ddp, 2, tmp_path, "accumulate", options, timeout=240)
    expected, steps = _one_device(Accumulating(), tmp_path)
    assert steps == 4
    assert [r["global_step"] for r in ranks] == [4, 4]
    # Under sync_grad=False each rank keeps its own gradient; the stepping batch's
    # backward averages the accumulated sums.
    assert ranks[0]["grads_agree"] == [False, True] * 4
    assert ranks[1]["grads_agree"] == ranks[0]["grads_agree"]
    _assert_same(ranks[0]["weights"], expected)
    _assert_same(ranks[1]["weights"], expected)


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_spawn_and_fork_run_manual_optimization(strategy: str, tmp_path: Path) -> None:
    model = GAN()
    trainer = _trainer(tmp_path, strategy=strategy, devices=2)
    trainer.fit(model, DataLoader(_data(), batch_size=4))
    expected, _ = _one_device(GAN(), tmp_path)
    # The launching process holds rank zero's weights.
    _assert_same(_weights(model), expected)
    assert trainer.global_step == 16


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ("deepspeed", r"DeepSpeedStrategy: the DeepSpeed engine owns one optimizer"),
        ("fsdp", r"FSDPStrategy.*Use strategy='ddp'"),
    ],
)
def test_strategies_that_cannot_run_it_refuse_before_starting(
    strategy: str, match: str, tmp_path: Path
) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    trainer = _trainer(tmp_path, strategy=strategy, devices=2)
    with pytest.raises(ConfigurationError, match=match):
        trainer.fit(GAN(), DataLoader(_data(), batch_size=4))


def test_several_backward_passes_per_batch_without_unused_parameter_search(
    tmp_path: Path,
) -> None:
    # With find_unused_parameters=False DDP's reducer rebuilds its buckets after the first
    # synchronised backward; here a second one comes before the next forward.
    options = {"find_unused_parameters": False}
    ranks = run_distributed(_fit_on_ddp, 2, tmp_path, "two_steps", options, timeout=240)
    expected, steps = _one_device(TwoStepsPerBatch(), tmp_path)
    assert steps == 16
    assert [r["global_step"] for r in ranks] == [16, 16]
    _assert_same(ranks[0]["weights"], expected)
    _assert_same(ranks[1]["weights"], expected)
