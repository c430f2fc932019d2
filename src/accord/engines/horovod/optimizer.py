"""Helpers for the optimizers `HorovodCollective.distributed_optimizer` returns.

Horovod's ``DistributedOptimizer`` reduces gradients in backward hooks; the strategy waits
for them (`HorovodCollective.synchronize`) before it clips or steps, then steps without
waiting again (`skip_synchronize`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["is_distributed_optimizer", "parameter_names", "skip_synchronize"]


def is_distributed_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a Horovod ``DistributedOptimizer`` (it has ``synchronize``)."""
    return hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize")


@contextlib.contextmanager
def skip_synchronize(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, ``optimizer.step()`` does not wait for the reductions again.

    For a Horovod ``DistributedOptimizer`` whose reductions were waited for; any other
    optimizer steps as usual.
    """
    if is_distributed_optimizer(optimizer):
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            yield
    else:
        yield


def parameter_names(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], index: int
) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) for every parameter of ``optimizer``: the module's names, else made up.

    Horovod names each gradient reduction after its parameter, so the names must be
    unique and the same on every rank. ``named`` is the module's ``named_parameters()``;
    a parameter not in it is named after ``index`` (the optimizer's position), its group
    and its place in the group.
    """
    names = {id(p): n for n, p in named}
    result: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            result.append((names.get(id(param), f"optimizer{index}.group{g}.param{j}"), param))
    return result
