"""Manual optimization (automatic_optimization = False): a GAN-style module with two
optimizers trains exactly as the same steps written in plain PyTorch. The multi-rank
cases are in test_manual_optimization_ddp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.errors import ConfigurationError


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(24, 4, generator=generator))


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 1))


class GAN(accord.Module):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = _nets()
        self.frozen_seen: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        noise = torch.randn(real.shape[0], 2, generator=torch.Generator().manual_seed(batch_idx))
        # The discriminator's step, the generator frozen.
        self.toggle_optimizer(d_opt)
        self.frozen_seen.append(not self.generator.weight.requires_grad)
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
        # The generator's step.
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


def _plain_pytorch(batches: int) -> dict[str, torch.Tensor]:
    generator, discriminator = _nets()
    g_opt = torch.optim.Adam(generator.parameters(), lr=0.01)
    d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(g_opt, 1, gamma=0.9)
    loader = DataLoader(_data(), batch_size=4)
    for batch_idx, (real,) in enumerate(loader):
        if batch_idx == batches:
            break
        noise = torch.randn(real.shape[0], 2, generator=torch.Generator().manual_seed(batch_idx))
        generator.requires_grad_(False)
        fake = generator(noise)
        d_loss = (
            nn.functional.softplus(-discriminator(real)).mean()
            + nn.functional.softplus(discriminator(fake.detach())).mean()
        )
        d_opt.zero_grad(set_to_none=True)
        d_loss.backward()
        nn.utils.clip_grad_norm_(discriminator.parameters(), 0.5)
        d_opt.step()
        generator.requires_grad_(True)
        discriminator.requires_grad_(False)
        g_loss = nn.functional.softplus(-discriminator(generator(noise))).mean()
        g_opt.zero_grad(set_to_none=True)
        g_loss.backward()
        g_opt.step()
        discriminator.requires_grad_(True)
        scheduler.step()
    return {
        **{f"generator.{k}": v for k, v in generator.state_dict().items()},
        **{f"discriminator.{k}": v for k, v in discriminator.state_dict().items()},
    }


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": root,
        **kwargs,
    }
    return accord.Trainer(**settings)


def test_two_optimizers_train_as_plain_pytorch(tmp_path: Path) -> None:
    model = GAN()
    trainer = _trainer(tmp_path)
    trainer.fit(model, DataLoader(_data(), batch_size=4))
    # Two optimizer steps per batch, as Lightning counts them.
    assert trainer.global_step == 12
    assert model.frozen_seen == [True] * 6
    assert all(p.requires_grad for p in model.parameters())
    expected = _plain_pytorch(6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert "d_loss" in trainer.callback_metrics


def test_max_steps_counts_manual_steps(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_steps=4, max_epochs=None)
    trainer.fit(GAN(), DataLoader(_data(), batch_size=4))
    assert trainer.global_step == 4


def test_what_manual_optimization_leaves_to_training_step_is_refused(tmp_path: Path) -> None:
    loader = DataLoader(_data(), batch_size=4)
    with pytest.raises(ConfigurationError, match=r"self\.clip_gradients"):
        _trainer(tmp_path, gradient_clip_val=1.0).fit(GAN(), loader)
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        _trainer(tmp_path, accumulate_grad_batches=2).fit(GAN(), loader)


def test_schedulers_step_only_when_training_step_steps_them(tmp_path: Path) -> None:
    # As in Lightning: no epoch-end step of its own under manual optimization.
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(GAN(), DataLoader(_data(), batch_size=4))
    (g_opt, _) = trainer.optimizers
    # training_step stepped the StepLR once per batch: 6 batches, 2 epochs.
    assert g_opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.9**12)
