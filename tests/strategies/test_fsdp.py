"""FSDP regression tests: real fits over gloo on CPU, each rank a real process.

Most rank functions create the process group themselves, so the strategies join it and
many fits (and the gathering of sharded weights after each) share one launch; the tests
of the registered names let the strategy create and destroy the group, as a user's run
does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import accord
from accord.engines.torch.fsdp import META_FILE, hybrid_mesh_shape
from accord.errors import ConfigurationError
from accord.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry
from accord.testing import run_distributed
from tests.helpers.models import loader

# FSDP and DDP run the same float32 arithmetic except the order of a few sums (the gradient
# norm over shards, reduce-scatter vs all-reduce). On 2 ranks here the weights agree to
# ~1e-9; the margin allows for other summation orders, and a wrong gradient, a missed sync
# or a local-only clipping norm moves them by 1e-2 or more.
RTOL, ATOL = 1e-5, 1e-6


class MLP(accord.Module):
    """Three linear layers (widths that do not split evenly over 3 ranks) and a parameter
    owned by the module itself, trained with SGD + momentum so the optimizer has state."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 1)
        )
        self.scale = nn.Parameter(torch.full((1,), 1.5))
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x) * self.scale).squeeze(-1)

    def prediction(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.prediction(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class BypassesForward(MLP):
    """A training_step that never calls ``self(x)``: it uses the layers and the module's own
    parameter directly, so FSDP hooks on the user's ``forward`` would never fire."""

    def prediction(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x) * self.scale).squeeze(-1)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full weights on every rank (gathers DTensor shards; collective)."""
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in module.state_dict().items()
    }


def _full_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, gathered on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return dict(state["state"])


def _trainer(strategy: accord.strategies.Strategy | str, **kwargs: Any) -> accord.Trainer:
    defaults: dict[str, Any] = {
        "devices": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "max_epochs": 2,
        "limit_train_batches": 4,
        "limit_val_batches": 2,
    }
    return accord.Trainer(strategy=strategy, **{**defaults, **kwargs})


def _fit(
    strategy: accord.strategies.Strategy,
    model: MLP | None = None,
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    model = model if model is not None else MLP()
    trainer = _trainer(strategy, **kwargs)
    # Validation runs FSDP's forward under no_grad between training epochs.
    trainer.fit(model, loader(batch_size=16), loader(batch_size=16), ckpt_path=ckpt_path)
    params = list(model.parameters())
    return {
        "weights": _full(model),
        "losses": model.losses,
        "steps": trainer.global_step,
        # What this rank holds: less than the whole model when FSDP sharded it.
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "mesh": tuple(params[0].device_mesh.shape) if isinstance(params[0], DTensor) else None,
    }


def _helpers(strategy: accord.strategies.Strategy, rank: int) -> dict[str, Any]:
    _trainer(strategy)
    strategy.setup_environment()
    try:
        return {
            "gather": strategy.all_gather(torch.arange(rank + 2)).tolist(),
            "broadcast": strategy.broadcast({"from": rank}, src=1),
            "tensor": strategy.broadcast(torch.tensor([rank, 10 * rank]), src=1).tolist(),
            "any": strategy.reduce_boolean_decision(rank == 1, all=False),
            "all": strategy.reduce_boolean_decision(rank == 1, all=True),
            "every": strategy.reduce_boolean_decision(True, all=True),
        }
    finally:
        strategy.teardown()


def _second_run_error() -> str:
    model = MLP()
    trainer = _trainer(FSDPStrategy())
    trainer.fit(model, loader(batch_size=16))
    with pytest.raises(ConfigurationError) as err:
        trainer.validate(model, loader(batch_size=16))
    return str(err.value)


def _many_fits(rank: int) -> dict[str, Any]:
    linear = {nn.Linear}
    step = {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "limit_train_batches": 8}
    params = sum(p.numel() for p in MLP().parameters())
    return {
        "ddp": _fit(DDPStrategy(), **step),
        "ddp_unclipped": _fit(DDPStrategy(), accumulate_grad_batches=2, limit_train_batches=8),
        "full_shard": _fit(FSDPStrategy(auto_wrap_policy=linear), **step),
        "size_policy": _fit(FSDPStrategy(min_num_params=params // 2), **step),
        "shard_grad_op": _fit(
            FSDPStrategy(auto_wrap_policy=linear, sharding_strategy="SHARD_GRAD_OP"), **step
        ),
        "hybrid": _fit(FSDPStrategy(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=1), **step),
        "cpu_offload": _fit(FSDPStrategy(auto_wrap_policy=linear, cpu_offload=True), **step),
        "ddp_bypass": _fit(DDPStrategy(), BypassesForward(), **step),
        "fsdp_bypass": _fit(FSDPStrategy(auto_wrap_policy=linear), BypassesForward(), **step),
        "ddp_bf16": _fit(DDPStrategy(), precision="bf16-mixed"),
        "fsdp_bf16": _fit(FSDPStrategy(auto_wrap_policy=linear), precision="bf16-mixed"),
        "helpers_ddp": _helpers(DDPStrategy(), rank),
        "helpers_fsdp": _helpers(FSDPStrategy(), rank),
        "second_run": _second_run_error(),
    }


def _two_rank_runs(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    # The test owns the group: the strategies join it, and it outlives each fit, so the
    # sharded weights can be gathered afterwards.
    dist.init_process_group("gloo")
    try:
        return {"fits": _many_fits(rank), "checkpoints": _checkpoint_runs(root)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every 2-rank fit of this module that joins a group, in one launch."""
    root = tmp_path_factory.mktemp("fsdp_checkpoints")
    return root, run_distributed(_two_rank_runs, 2, root, timeout=180)


@pytest.fixture(scope="module")
def fits(two_rank_runs: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What `_many_fits` returned on each rank."""
    return [result["fits"] for result in two_rank_runs[1]]


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=key)


def _loss_fell(losses: list[float]) -> bool:
    half = len(losses) // 2
    return sum(losses[half:]) < 0.9 * sum(losses[:half])


@pytest.mark.parametrize(
    ("run", "reference", "mesh"),
    [
        ("full_shard", "ddp", (2,)),
        ("size_policy", "ddp", (2,)),
        ("shard_grad_op", "ddp", (2,)),
        ("hybrid", "ddp", (2, 1)),
        ("cpu_offload", "ddp", (2,)),
        ("fsdp_bypass", "ddp_bypass", (2,)),
    ],
)
def test_fsdp_trains_to_the_ddp_weights(
    fits: list[dict[str, Any]], run: str, reference: str, mesh: tuple[int, ...]
) -> None:
    for result in fits:
        fsdp, ddp = result[run], result[reference]
        assert fsdp["steps"] == ddp["steps"] == 8  # 16 batches, accumulated in pairs
        assert _loss_fell(fsdp["losses"])
        assert fsdp["mesh"] == mesh
        if mesh == (2,):  # each rank holds about half of the 224 parameters
            assert fsdp["local_numel"] < ddp["local_numel"] == 224
        _assert_same_weights(fsdp["weights"], ddp["weights"])
        _assert_same_weights(fsdp["weights"], fits[0][run]["weights"])


def test_gradient_clipping_takes_effect(fits: list[dict[str, Any]]) -> None:
    # Otherwise the clipped FSDP/DDP comparison above would not test clipping at all.
    clipped, unclipped = fits[0]["ddp"]["weights"], fits[0]["ddp_unclipped"]["weights"]
    assert not torch.allclose(clipped["scale"], unclipped["scale"], rtol=1e-3)


def test_bf16_mixed_keeps_fp32_weights_and_trains(fits: list[dict[str, Any]]) -> None:
    fsdp, ddp = fits[0]["fsdp_bf16"], fits[0]["ddp_bf16"]
    assert all(w.dtype == torch.float32 for w in fsdp["weights"].values())
    assert _loss_fell(fsdp["losses"])
    # bf16 compute (8-bit mantissa) on both sides, in different places: loose agreement.
    for key in ddp["weights"]:
        torch.testing.assert_close(fsdp["weights"][key], ddp["weights"][key], rtol=0.02, atol=0.02)


def test_a_module_sharded_by_a_finished_run_is_refused_clearly(
    fits: list[dict[str, Any]],
) -> None:
    for result in fits:
        assert "already sharded by an earlier FSDP run" in result["second_run"]


def test_communication_helpers_agree_with_ddp(fits: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(fits):
        assert result["helpers_fsdp"] == result["helpers_ddp"]
        helpers = result["helpers_fsdp"]
        assert helpers["gather"] == [0, 1, 0, 1, 2]
        assert helpers["broadcast"] == {"from": 1}
        assert helpers["tensor"] == [1, 10]
        assert (helpers["any"], helpers["all"], helpers["every"]) == (True, False, True), rank


# --------------------------------------------------------------- registered names
class PlateauOnRankOne(MLP):
    """Rank 1's validation score stops improving after epoch 1; rank 0's keeps improving."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        value = 1.0 / (epoch + 1) if self.global_rank == 0 or epoch < 1 else 0.5
        self.log("score", torch.tensor(value))  # not synced: each rank judges its own


def _named_fit(rank: int, world_size: int, name: str) -> dict[str, Any]:
    model = PlateauOnRankOne()
    trainer = _trainer(
        name,
        max_epochs=20,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[accord.callbacks.EarlyStopping("score", patience=2)],
    )
    trainer.fit(model, loader(batch_size=16), loader(batch_size=16))
    strategy = trainer.strategy
    assert isinstance(strategy, FSDPStrategy)
    # The strategy created the process group, so its teardown destroyed it again.
    assert not dist.is_initialized()
    return {"epoch": trainer.current_epoch, "losses": model.losses, "offload": strategy.cpu_offload}


# One launch each: a second group on the same port in the same processes could race.
@pytest.mark.parametrize(("name", "offload"), [("fsdp", False), ("fsdp_cpu_offload", True)])
def test_registered_names_fit_and_stop_every_rank_together(name: str, offload: bool) -> None:
    results = run_distributed(_named_fit, 2, name, timeout=90)
    # Rank 1 asks to stop after epoch 3 (no improvement at epochs 2 and 3); rank 0 keeps
    # improving but stops with it.
    assert [r["epoch"] for r in results] == [4, 4]
    for result in results:
        assert result["offload"] is offload
        assert _loss_fell(result["losses"])


# -------------------------------------------------------------------- checkpoints
def _checkpoint_runs(root: Path) -> dict[str, Any]:
    uninterrupted = _fit(FSDPStrategy(auto_wrap_policy={nn.Linear}), max_epochs=4)
    results: dict[str, Any] = {"uninterrupted": uninterrupted["weights"]}
    for kind in ("sharded", "full"):
        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=kind)
        first = MLP()
        saver = accord.callbacks.ModelCheckpoint(dirpath=root / kind, save_last=True)
        trainer = _trainer(strategy, callbacks=[saver], enable_checkpointing=True)
        # It saves after validation, when FSDP's root unit still holds gathered weights.
        trainer.fit(first, loader(batch_size=16), loader(batch_size=16))
        results[f"{kind}_saved"] = {
            "weights": _full(first),
            "optimizer": _full_optimizer(first, trainer.optimizers[0]),
        }
        resumed = _fit(
            FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=kind),
            max_epochs=4,
            ckpt_path=root / kind / "last.ckpt",
        )
        results[f"{kind}_resumed"] = resumed["weights"]
    # A DDP checkpoint (plain state dicts, numbered optimizer state) resumes under FSDP.
    saver = accord.callbacks.ModelCheckpoint(dirpath=root / "ddp", save_last=True)
    _fit(DDPStrategy(), callbacks=[saver], enable_checkpointing=True)
    results["ddp_resumed"] = _fit(
        FSDPStrategy(), max_epochs=4, ckpt_path=root / "ddp" / "last.ckpt"
    )["weights"]
    return results


@pytest.fixture(scope="module")
def checkpoints(
    two_rank_runs: tuple[Path, list[dict[str, Any]]],
) -> tuple[Path, list[dict[str, Any]]]:
    """Where 2 ranks wrote sharded, full and DDP checkpoints, and what was in them."""
    root, results = two_rank_runs
    return root, [result["checkpoints"] for result in results]


def test_checkpoint_files_on_disk(checkpoints: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = checkpoints
    # save_top_k=1 removed epoch 0's checkpoint; no temporary names are left behind.
    assert sorted(p.name for p in (root / "sharded").iterdir()) == [
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    last = root / "sharded" / "last.ckpt"
    assert last.is_dir() and (last / META_FILE).is_file() and (last / ".metadata").is_file()
    full = root / "full" / "last.ckpt"
    assert full.is_file()
    checkpoint = torch.load(full, weights_only=True)
    # The full kind is a plain state dict with the user's module's own key names.
    model = MLP()
    model.load_state_dict(checkpoint["state_dict"])
    assert checkpoint["global_step"] == 8


@pytest.mark.parametrize("kind", ["sharded", "full", "ddp"])
def test_resume_reaches_the_uninterrupted_weights(
    checkpoints: tuple[Path, list[dict[str, Any]]], kind: str
) -> None:
    _, results = checkpoints
    for result in results:
        _assert_same_weights(result[f"{kind}_resumed"], result["uninterrupted"])


def _load_sharded(rank: int, world_size: int, path: Path) -> dict[str, Any]:
    dist.init_process_group("gloo")
    try:
        model = MLP()
        trainer = _trainer(FSDPStrategy(), devices=world_size, max_epochs=2)
        # The checkpoint finished epoch 1, so this fit restores it and trains no further.
        trainer.fit(model, loader(batch_size=16), ckpt_path=path)
        evaluated = MLP()
        trainer.validate(evaluated, loader(batch_size=16), ckpt_path=path)  # model only
        return {
            "steps": trainer.global_step,
            "weights": _full(model),
            "optimizer": _full_optimizer(model, trainer.optimizers[0]),
            "validated": _full(evaluated),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_checkpoint_of_two_ranks_loads_into(
    checkpoints: tuple[Path, list[dict[str, Any]]], world_size: int
) -> None:
    root, saved = checkpoints
    expected = saved[0]["sharded_saved"]
    for result in run_distributed(
        _load_sharded, world_size, root / "sharded" / "last.ckpt", timeout=90
    ):
        assert result["steps"] == 8
        _assert_same_weights(result["weights"], expected["weights"])
        _assert_same_weights(result["validated"], expected["weights"])
        assert result["optimizer"].keys() == expected["optimizer"].keys()
        for name, state in expected["optimizer"].items():
            torch.testing.assert_close(
                result["optimizer"][name]["momentum_buffer"], state["momentum_buffer"]
            )


# ---------------------------------------------------------------- configuration
def test_registry_names_build_fsdp_strategies() -> None:
    plain = StrategyRegistry.get("fsdp").build()
    offload = StrategyRegistry.get("fsdp_cpu_offload").build()
    assert isinstance(plain, FSDPStrategy) and not plain.cpu_offload
    assert isinstance(offload, FSDPStrategy) and offload.cpu_offload


def test_wrap_policies_choose_the_units() -> None:
    model = MLP()
    net = model.net
    by_class = FSDPStrategy(auto_wrap_policy={nn.Linear, MLP})._units(model)
    # Children before parents; the user's module itself always stays in the root unit.
    assert by_class == [net[0], net[2], net[4]]
    # net.0 holds 117 parameters, net.2 98, net.4 8: with 100, net.0 is a unit, and
    # net.2 + net.4 (106 not yet in a unit) make the Sequential one.
    assert FSDPStrategy(min_num_params=100)._units(model) == [net[0], net]
    assert FSDPStrategy()._units(model) == []


def test_hybrid_mesh_shape() -> None:
    assert hybrid_mesh_shape(4, 2) == (2, 2)
    assert hybrid_mesh_shape(2, 1) == (2, 1)
    with pytest.raises(ConfigurationError, match="at least 2 processes"):
        hybrid_mesh_shape(1, 1)
    with pytest.raises(ConfigurationError, match="does not divide world_size=6"):
        hybrid_mesh_shape(6, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sharding_strategy": "NO_SHARD"},
        {"state_dict_type": "local"},
        {"min_num_params": 0},
        {"hybrid_shard_size": 0},
    ],
)
def test_invalid_options_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        FSDPStrategy(**kwargs)
