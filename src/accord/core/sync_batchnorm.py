"""`SyncBatchNorm`: BatchNorm whose batch statistics are taken over every rank.

In training, each layer sums its input's per-channel count, sum and sum of squares, and
one ``all_reduce(sum)`` through the strategy's collective gives every rank the statistics
of the global batch; the backward pass sums the gradients of those statistics the same
way (`accord.core.autograd`). So it runs on any collective, CPU and gloo included (torch's
own ``SyncBatchNorm`` needs a GPU), and its traffic shows up where every other collective
call does (debug checks, the watchdog, the timeline). In eval mode, or with one rank, it is
a plain BatchNorm.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from accord.core.autograd import all_reduce_with_grad
from accord.core.collective import Collective

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer (1d, 2d or 3d input) synchronised through ``collective``.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as `torch.nn.BatchNorm1d`.
        collective: the collective the statistics are summed on (set by
            `convert_sync_batchnorm`).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        collective: Collective | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.collective = collective

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of 2 or more dimensions, got {input.dim()}."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of every rank's batch (in training)."""
        self._check_input_dim(input)
        collective = self.collective
        if (
            not self.training
            or collective is None
            or not collective.is_setup
            or collective.world_size == 1
        ):
            return super().forward(input)
        return self._synced_forward(input, collective)

    def _synced_forward(self, input: torch.Tensor, collective: Collective) -> torch.Tensor:
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        compute = input.float()
        count = torch.full((1,), input.numel() / channels, dtype=torch.float32, device=input.device)
        local = torch.cat([compute.sum(dims), (compute * compute).sum(dims), count])
        total = all_reduce_with_grad(collective, local)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean.detach(), var.detach(), float(n))
        shape = [1, channels] + [1] * (input.dim() - 2)
        normed = (compute - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            normed = normed * self.weight.view(shape) + self.bias.view(shape)
        return normed.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, collective: Collective) -> nn.Module:
    """``module`` with every BatchNorm layer (and torch's ``SyncBatchNorm``) replaced by a
    `SyncBatchNorm` on ``collective``, keeping its parameters, buffers and mode."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted: nn.Module = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            collective,
        )
        converted.load_state_dict(module.state_dict())
        converted.to(next(iter(module.state_dict().values()), torch.empty(0)).device)
        converted.train(module.training)
        return converted
    if isinstance(module, SyncBatchNorm):
        module.collective = collective
    for name, child in module.named_children():
        replaced = convert_sync_batchnorm(child, collective)
        if replaced is not child:
            module.add_module(name, replaced)
    return module
