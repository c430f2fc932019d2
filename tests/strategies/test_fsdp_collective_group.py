"""FSDP shards over the process group of the collective it is given, wrapped or not.

Three real processes over gloo: ranks 1 and 2 form a sub-group and train on it with a
user's `TorchCollective` subclass, while rank 0 trains the same data on one device as the
reference. FSDP must build its mesh from the collective and carry its shards on the
sub-group: each member then holds half of every sharded parameter, where a mesh over the
whole world would hand it a third. Under debug mode the collective is wrapped in a
`DebugCollective`; the wrapper must not hide the sub-group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import accord
from accord.collectives import DebugCollective, TorchCollective
from accord.strategies import DDPStrategy, FSDPStrategy, Strategy
from accord.testing import run_distributed
from tests.helpers.models import loader

MEMBERS = [1, 2]
PARAMETERS = 8 * 12 + 12 + 12 + 1


class PairCollective(TorchCollective):
    """A user's collective on one sub-group that remembers the meshes it built."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__("gloo", group=group)
        self.meshes: list[DeviceMesh] = []

    def device_mesh(
        self,
        shape: Sequence[int],
        mesh_dim_names: Sequence[str] | None = None,
        *,
        device_type: str | None = None,
    ) -> DeviceMesh:
        mesh = super().device_mesh(shape, mesh_dim_names, device_type=device_type)
        self.meshes.append(mesh)
        return mesh


class SmallMLP(accord.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 1))
        self.identity: tuple[int, int] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.identity = (self.trainer.world_size, self.global_rank)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit(strategy: Strategy | str, devices: int, batch_size: int) -> SmallMLP:
    model = SmallMLP()
    trainer = accord.Trainer(
        strategy=strategy,
        devices=devices,
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=batch_size))
    assert trainer.global_step == 8
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in model.state_dict().items()
    }


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _fsdp_fit(pair: dist.ProcessGroup, *, debug: bool, **options: Any) -> dict[str, Any]:
    collective = PairCollective(pair)
    strategy = FSDPStrategy(collective=collective, debug=debug, **options)
    model = _fit(strategy, devices=2, batch_size=16)
    # The strategy's ranks are the sub-group's.
    assert model.identity == (2, MEMBERS.index(dist.get_rank()))
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    mesh = params[0].device_mesh
    shard_dim = "shard" if mesh.ndim == 2 else None
    return {
        "wrapped": isinstance(strategy.collective, DebugCollective),
        # Equal, not identical: torch may hand out an earlier run's equal mesh object.
        "mesh_from_collective": bool(collective.meshes)
        and all(p.device_mesh == collective.meshes[-1] for p in params),
        "all_sharded": len(params) == 4,
        "shard_group": _ranks(mesh.get_group(shard_dim)),
        "same_group": mesh.ndim == 2 or mesh.get_group().group_name == pair.group_name,
        "other_groups": [_ranks(mesh.get_group(d)) for d in range(mesh.ndim - 1)],
        "local_numel": sum(p.to_local().numel() for p in params),
        "weights": _weights(model),
    }


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        pair = dist.new_group(MEMBERS)  # every rank of the world takes part in making it
        if rank not in MEMBERS:
            # The same global batch (2 ranks x 16) on one device.
            return {"reference": _weights(_fit("single_device", devices=1, batch_size=32))}
        results = {
            "plain": _fsdp_fit(pair, debug=False, auto_wrap_policy={nn.Linear}),
            "debug": _fsdp_fit(pair, debug=True, auto_wrap_policy={nn.Linear}),
            "ddp": {"weights": _weights(_fit(DDPStrategy(collective=PairCollective(pair)), 2, 16))},
        }
        os.environ["ACCORD_DEBUG_COLLECTIVES"] = "1"
        try:
            results["hybrid_debug_env"] = _fsdp_fit(
                pair, debug=False, sharding_strategy="HYBRID_SHARD", hybrid_shard_size=2
            )
        finally:
            del os.environ["ACCORD_DEBUG_COLLECTIVES"]
        return results
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_runs, 3, timeout=240)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("run", "wrapped"), [("plain", False), ("debug", True), ("hybrid_debug_env", True)]
)
def test_fsdp_shards_over_the_collectives_sub_group(
    runs: list[dict[str, Any]], run: str, wrapped: bool
) -> None:
    members = [runs[rank][run] for rank in MEMBERS]
    for result in members:
        assert result["wrapped"] is wrapped
        assert result["mesh_from_collective"] and result["all_sharded"]
        assert result["shard_group"] == MEMBERS and result["same_group"]
        for ranks in result["other_groups"]:  # the hybrid mesh's replicate groups
            assert len(ranks) == 1 and set(ranks) <= set(MEMBERS)
    # Two shards of every parameter, one on each member: a mesh over the three ranks of
    # the world would leave the members a third of each.
    assert sum(result["local_numel"] for result in members) == PARAMETERS
    for result in members:
        _assert_same(result["weights"], runs[1]["ddp"]["weights"])
        _assert_same(result["weights"], runs[0]["reference"])


def test_ddp_on_the_sub_group_matches_one_device(runs: list[dict[str, Any]]) -> None:
    for rank in MEMBERS:
        _assert_same(runs[rank]["ddp"]["weights"], runs[0]["reference"])
