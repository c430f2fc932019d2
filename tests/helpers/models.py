"""Small models and data shared by the strategy regression tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accord
from accord.collectives import ReduceOpLike, TorchCollective


def regression_data(samples: int = 256, features: int = 8, seed: int = 0) -> TensorDataset:
    """A linear regression problem with a little noise, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    w = torch.randn(features, generator=generator)
    y = x @ w + 0.01 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y)


class LinearModel(accord.Module):
    """A linear layer trained with SGD; logs its loss (synced across ranks)."""

    def __init__(self, features: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(features, 1)
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, prog_bar=True)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(batch_size: int, samples: int = 256, shuffle: bool = False) -> DataLoader[Any]:
    """A DataLoader over `regression_data`."""
    return DataLoader(regression_data(samples), batch_size=batch_size, shuffle=shuffle)


def flat_weights(module: nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one vector."""
    return torch.cat([p.detach().flatten() for p in module.parameters()])


class CountingCollective(TorchCollective):
    """A TorchCollective that counts the calls it serves."""

    def __init__(self) -> None:
        super().__init__("gloo")
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._count("all_reduce")
        return super().all_reduce(tensor, op, out=out)

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        self._count("all_gather")
        return super().all_gather(tensor, out=out)


class FailingModel(LinearModel):
    """On ``fail_rank``, at batch 2 of the first epoch: raise, or SIGKILL its own process."""

    def __init__(self, fail_rank: int, how: str = "raise") -> None:
        super().__init__()
        self.fail_rank = fail_rank
        self.how = how

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2 and self.global_rank == self.fail_rank:
            if self.how == "kill":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {self.fail_rank} fails on purpose")
        return super().training_step(batch, batch_idx)


class LostPeerModel(LinearModel):
    """At batch 2 ``fail_rank`` sleeps ``delay`` seconds and SIGKILLs itself; the other ranks
    raise at once the error gloo raises when a peer has gone, so they report first."""

    def __init__(self, fail_rank: int, delay: float = 1.0) -> None:
        super().__init__()
        self.fail_rank = fail_rank
        self.delay = delay

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            if self.global_rank == self.fail_rank:
                import os
                import signal
                import time

                time.sleep(self.delay)
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("Read error [127.0.0.1]:1234: Connection reset by peer")
        return super().training_step(batch, batch_idx)


class SlowTeardownModel(FailingModel):
    """A `FailingModel` whose ``teardown`` takes ``seconds``, like cleanup that flushes files."""

    def __init__(self, fail_rank: int, how: str = "raise", seconds: float = 1.0) -> None:
        super().__init__(fail_rank, how)
        self.seconds = seconds

    def teardown(self, stage: str) -> None:
        import time

        time.sleep(self.seconds)
        super().teardown(stage)
