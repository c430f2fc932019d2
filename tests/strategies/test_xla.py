"""XLA regression tests on torch_xla's CPU runtime (``PJRT_DEVICE=CPU``): real ranks, real fits.

Multi-rank runs use torch_xla's own launcher (``xmp.spawn`` through `XLALauncher`): one
process with ``CPU_NUM_DEVICES`` devices and a thread per device, which is how torch_xla
runs several devices of one host. The test process itself never starts the XLA runtime,
because torch_xla cannot launch ranks from a process where it runs.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torch_xla") is not None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla picks its runtime
pytest.importorskip("torch_xla", reason="needs torch_xla: `make test-xla` runs this file")

import torch

import accord
from accord.callbacks import ModelCheckpoint
from accord.checkpoint import describe_checkpoint
from accord.engines.xla.collective import XLACollective
from accord.engines.xla.environment import XLAEnvironment
from accord.engines.xla.launcher import XLALauncher
from accord.engines.xla.strategy import SingleDeviceXLAStrategy, XLAStrategy
from accord.errors import ConfigurationError, RankFailureError
from accord.strategies import StrategyRegistry
from accord.testing import assert_strategies_agree, run_checks_in_this_process
from tests.helpers.models import CountingCollective, LinearModel, flat_weights, loader

del CountingCollective  # the torch.distributed one; XLA ranks count with their own below

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _runtime_stays_off_here() -> Any:
    """Every test leaves the XLA runtime off in this process, so later ones can launch."""
    import torch_xla

    yield
    assert not torch_xla._XLAC._xla_runtime_is_initialized()


def _record(fn: Callable[..., Any], directory: str, world_size: int, *args: Any) -> None:
    import torch_xla.runtime as xr

    rank = int(xr.global_ordinal())
    result = fn(rank, world_size, *args)
    (Path(directory) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_xla_ranks(
    fn: Callable[..., Any], world_size: int, directory: Path, *args: Any
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` XLA ranks; each rank's result."""
    directory.mkdir(parents=True, exist_ok=True)
    XLALauncher(XLAEnvironment(), world_size).launch(_record, fn, str(directory), world_size, *args)
    return [
        pickle.loads((directory / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)
    ]


def _trainer(**kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        **kwargs,
    }
    return accord.Trainer(**settings)


def _cpu_weights(batch_size: int, epochs: int = 2) -> torch.Tensor:
    """The same optimisation on one CPU device, in plain PyTorch (no XLA)."""
    model = LinearModel()
    _trainer(strategy="single_device", accelerator="cpu", max_epochs=epochs).fit(
        model, loader(batch_size=batch_size)
    )
    return flat_weights(model)


# ----------------------------------------------------------------- the collective
def _conformance(rank: int, world_size: int) -> list[Any]:
    return run_checks_in_this_process(XLACollective, rank=rank, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_xla_collective_passes_the_conformance_suite(world_size: int, tmp_path: Path) -> None:
    per_rank = run_xla_ranks(_conformance, world_size, tmp_path)
    assert per_rank == [[]] * world_size, "\n".join(str(v) for vs in per_rank for v in vs)


class PlateauOnRankOne(LinearModel):
    """Rank 1's validation metric stops improving after epoch 1; the others keep improving."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        value = 1.0 / (epoch + 1) if self.global_rank != 1 or epoch < 1 else 0.5
        self.log("score", torch.tensor(value))  # not synced: each rank judges its own


def _decisions_and_device_tensors(rank: int, world_size: int, model: LinearModel) -> dict[str, Any]:
    import torch_xla

    strategy = XLAStrategy()
    _trainer(strategy=strategy, accelerator="xla", devices=world_size)
    strategy.setup_environment()
    device = torch_xla.device()
    try:
        on_device = torch.arange(3.0, device=device) + torch.tensor([float(rank)]).to(device)
        summed = strategy.collective.all_reduce(on_device, "sum")
        in_place = on_device.clone()
        strategy.collective.all_reduce(in_place, "max", out=in_place)
        from_two = torch.empty(3, device=device)
        strategy.collective.broadcast(on_device, src=2, out=from_two)
        gathered = strategy.collective.all_gather(on_device)
        helpers = {
            "gather": strategy.all_gather(torch.arange(rank + 1)).tolist(),
            "mean": float(strategy.reduce(torch.tensor(float(rank)))),
            "object": strategy.broadcast({"from": rank}, src=1),
            "any": strategy.reduce_boolean_decision(rank == 2, all=False),
            "all": strategy.reduce_boolean_decision(rank == 2, all=True),
            "every": strategy.reduce_boolean_decision(True, all=True),
            "device": (summed.device.type, in_place.device.type),
            "summed": summed.cpu().tolist(),
            "in_place": in_place.cpu().tolist(),
            "from_two": (from_two.device.type, from_two.cpu().tolist()),
            "gathered": (gathered.device.type, gathered.cpu().tolist()),
            "input_kept": on_device.cpu().tolist(),
        }
    finally:
        strategy.teardown()
    trainer = _trainer(
        strategy="xla",
        accelerator="xla",
        devices=world_size,
        max_epochs=20,
        limit_train_batches=2,
        callbacks=[accord.callbacks.EarlyStopping("score", patience=2)],
    )
    trainer.fit(model, loader(batch_size=16), loader(batch_size=16))
    return {**helpers, "stopped_after": trainer.current_epoch}


def test_decisions_helpers_and_early_stopping_across_three_ranks(tmp_path: Path) -> None:
    results = run_xla_ranks(_decisions_and_device_tensors, 3, tmp_path, PlateauOnRankOne())
    for rank, result in enumerate(results):
        assert result["gather"] == [0, 0, 1, 0, 1, 2]
        assert result["mean"] == 1.0
        assert result["object"] == {"from": 1}
        # Only rank 2 says yes: any-rank is True everywhere, all-ranks False everywhere.
        assert (result["any"], result["all"], result["every"]) == (True, False, True)
        assert result["device"] == ("xla", "xla")
        assert result["summed"] == [3.0, 6.0, 9.0]
        assert result["in_place"] == [2.0, 3.0, 4.0]
        assert result["from_two"] == ("xla", [2.0, 3.0, 4.0])
        assert result["gathered"] == ("xla", [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0], [2.0, 3.0, 4.0]])
        assert result["input_kept"] == [float(rank), rank + 1.0, rank + 2.0]
        # Rank 1 logs 1.0, 0.5, 0.5, 0.5: with patience=2 it asks to stop after epoch 3,
        # and every rank stops with it.
        assert result["stopped_after"] == 4


# ------------------------------------------------------------------------ fits
class CountingXLACollective(XLACollective):
    """An XLACollective that counts its all_reduce calls."""

    def __init__(self) -> None:
        super().__init__()
        self.all_reduces = 0

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.all_reduces += 1
        return super().all_reduce(tensor, op, out=out)


def _fits(rank: int, world_size: int, model: LinearModel, root: str) -> dict[str, Any]:
    import copy

    def fit(strategy: Any, epochs: int, start: LinearModel, **kwargs: Any) -> Any:
        trainer = _trainer(
            strategy=strategy, accelerator="xla", devices=world_size, max_epochs=epochs, **kwargs
        )
        trainer.fit(start, loader(batch_size=16))
        return trainer

    full_model = copy.deepcopy(model)
    if rank:  # the strategy starts every rank from rank 0's weights
        with torch.no_grad():
            full_model.layer.weight.add_(float(rank))
    full = fit("xla", 2, full_model)
    first = copy.deepcopy(model)
    fit("xla", 1, first, enable_checkpointing=True, default_root_dir=root)
    resumed_model = copy.deepcopy(model)
    resumed = _trainer(
        strategy="xla", accelerator="xla", devices=world_size, max_epochs=2, default_root_dir=root
    )
    resumed.fit(resumed_model, loader(batch_size=16), ckpt_path="last")
    counting = CountingXLACollective()
    via_collective_model = copy.deepcopy(model)
    fit(XLAStrategy(collective=counting, gradient_sync="collective"), 2, via_collective_model)
    clipped_model = copy.deepcopy(model)  # also checks every call's agreement (debug)
    fit(XLAStrategy(debug=True), 2, clipped_model, gradient_clip_val=1e6)
    return {
        "weights": flat_weights(full_model).cpu(),
        "losses": full_model.losses,
        "steps": full.global_step,
        "resumed": flat_weights(resumed_model).cpu(),
        "resumed_steps": resumed.global_step,
        "via_collective": flat_weights(via_collective_model).cpu(),
        "collective_all_reduces": counting.all_reduces,
        "clipped": flat_weights(clipped_model).cpu(),
    }


def test_two_rank_fits_agree_resume_and_match_one_device(tmp_path: Path) -> None:
    results = run_xla_ranks(_fits, 2, tmp_path / "ranks", LinearModel(), str(tmp_path / "run"))
    expected = _cpu_weights(batch_size=32)  # 2 ranks x 16 is one batch of 32
    steps = 2 * 256 // (16 * 2)
    for result in results:
        assert result["steps"] == steps
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
        torch.testing.assert_close(result["weights"], expected, rtol=1e-4, atol=1e-5)
        assert result["losses"][-1] < result["losses"][0] / 4
        # One epoch, a checkpoint, then the second epoch: the same weights as two at once.
        assert result["resumed_steps"] == steps
        torch.testing.assert_close(result["resumed"], result["weights"], rtol=1e-5, atol=1e-6)
        # Gradients through the collective (2 parameters per step) give the same training;
        # so do clipped gradients that clipping leaves alone (averaged once, not twice).
        assert result["collective_all_reduces"] >= 2 * steps
        torch.testing.assert_close(result["via_collective"], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result["clipped"], result["weights"], rtol=1e-5, atol=1e-6)


def test_trainer_launches_the_ranks_and_returns_rank_zero_weights() -> None:
    model = LinearModel()
    trainer = _trainer(strategy="xla", devices=2, max_epochs=2)
    assert isinstance(trainer.strategy, XLAStrategy)
    assert isinstance(trainer.strategy.launcher, XLALauncher)
    trainer.fit(model, loader(batch_size=16))
    torch.testing.assert_close(flat_weights(model), _cpu_weights(32), rtol=1e-4, atol=1e-5)
    assert trainer.global_step == 16
    assert float(trainer.callback_metrics["train_loss_epoch"]) < 1.0
    assert "CPU_NUM_DEVICES" not in os.environ  # set for the ranks only
    # Rank 0's predictions (its half of the data) come home as CPU tensors.
    predictions = trainer.predict(model, loader(batch_size=64))
    assert [p.shape for p in predictions] == [torch.Size([64])] * 2
    assert {p.device.type for p in predictions} == {"cpu"}


def _single(rank: int, world_size: int, model: LinearModel, root: str) -> dict[str, Any]:
    import copy

    first = copy.deepcopy(model)
    single = _trainer(
        strategy="single_xla", max_epochs=1, enable_checkpointing=True, default_root_dir=root
    )
    assert isinstance(single.strategy, SingleDeviceXLAStrategy)
    single.fit(first, loader(batch_size=16))
    resumed = copy.deepcopy(model)
    _trainer(strategy="single_xla", max_epochs=2, default_root_dir=root).fit(
        resumed, loader(batch_size=16), ckpt_path="last"
    )
    full = copy.deepcopy(model)
    _trainer(strategy="single_xla", max_epochs=2).fit(full, loader(batch_size=16))
    strategy = single.strategy
    return {
        "full": flat_weights(full).cpu(),
        "losses": full.losses,
        "resumed": flat_weights(resumed).cpu(),
        "device": str(strategy.root_device.type),
        "collective": type(strategy.collective).__name__,
    }


def test_single_xla_fits_and_resumes(tmp_path: Path) -> None:
    (result,) = run_xla_ranks(_single, 1, tmp_path / "ranks", LinearModel(), str(tmp_path))
    assert (result["device"], result["collective"]) == ("xla", "XLACollective")
    assert result["losses"][-1] < result["losses"][0] / 4
    torch.testing.assert_close(result["full"], _cpu_weights(16), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result["resumed"], result["full"], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ precision
# The dtype of the parameters and of the batches the step receives: the true modes convert
# both, bf16-mixed keeps them in float32 and computes under autocast.
DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "bf16-mixed": torch.float32}


class DtypeRecorder(LinearModel):
    """`LinearModel` that records the dtypes of the batches its steps receive."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_dtypes: set[torch.dtype] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_dtypes.update(t.dtype for t in batch)
        return super().training_step(batch, batch_idx)


def _precision_fit(
    rank: int, world_size: int, model: DtypeRecorder, strategy: str, precision: str
) -> dict[str, Any]:
    """A float32 dataset in ``precision``, with accumulation and clipping."""
    import copy

    model = copy.deepcopy(model)
    # As the other tests build them: the single-device strategy picks its device itself.
    devices = {"accelerator": "xla", "devices": world_size} if strategy == "xla" else {}
    trainer = _trainer(
        strategy=strategy,
        precision=precision,
        max_epochs=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        **devices,
    )
    trainer.fit(model, loader(batch_size=16))
    return {
        "weights": flat_weights(model).cpu(),
        "param_dtypes": {p.dtype for p in model.parameters()},
        "batch_dtypes": model.batch_dtypes,
        "losses": model.losses,
        "steps": trainer.global_step,
    }


def _check_precision(result: dict[str, Any], precision: str, steps: int) -> None:
    assert result["param_dtypes"] == {DTYPES[precision]}
    assert result["batch_dtypes"] == {DTYPES[precision]}
    assert result["steps"] == steps
    # Clipped at 0.5 with lr 0.1, a step moves the weights by 0.05 at most: compare the
    # first epoch's losses with the third's (about 25% lower on two ranks on CPU).
    losses = result["losses"]
    per_epoch = len(losses) // 3
    assert sum(losses[-per_epoch:]) < 0.85 * sum(losses[:per_epoch]), losses


@pytest.mark.parametrize("precision", list(DTYPES))
def test_a_float32_dataset_trains_on_two_ranks(tmp_path: Path, precision: str) -> None:
    results = run_xla_ranks(_precision_fit, 2, tmp_path, DtypeRecorder(), "xla", precision)
    for result in results:
        # 8 batches of 16 per rank and epoch, accumulated in pairs, 3 epochs.
        _check_precision(result, precision, steps=12)
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)


@pytest.mark.parametrize("precision", list(DTYPES))
def test_a_float32_dataset_trains_on_one_xla_device(tmp_path: Path, precision: str) -> None:
    (result,) = run_xla_ranks(_precision_fit, 1, tmp_path, DtypeRecorder(), "single_xla", precision)
    _check_precision(result, precision, steps=24)


class NativeCountingXLACollective(XLACollective):
    """An XLACollective that counts the fused average-and-step calls."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_steps = 0

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps += 1
        super().optimizer_step(optimizer)


def _narrow_without_clipping(
    rank: int, world_size: int, model: DtypeRecorder, precision: str
) -> dict[str, Any]:
    import copy

    model = copy.deepcopy(model)
    collective = NativeCountingXLACollective()
    trainer = _trainer(
        strategy=XLAStrategy(collective=collective, debug=True),
        precision=precision,
        accelerator="xla",
        devices=world_size,
        max_epochs=3,
        accumulate_grad_batches=2,
    )
    trainer.fit(model, loader(batch_size=16))
    return {
        "weights": flat_weights(model).cpu(),
        "param_dtypes": {p.dtype for p in model.parameters()},
        "batch_dtypes": model.batch_dtypes,
        "losses": model.losses,
        "steps": trainer.global_step,
        "collective_steps": collective.optimizer_steps,
    }


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_narrow_gradients_are_averaged_natively_without_clipping(
    tmp_path: Path, precision: str
) -> None:
    # Without clipping the step itself averages the gradients: the CPU runtime has no
    # bfloat16/float16 all-reduce, so they travel as float32 there too. The strategy's
    # collective (behind the debug wrapper) carries every step.
    results = run_xla_ranks(_narrow_without_clipping, 2, tmp_path, DtypeRecorder(), precision)
    for result in results:
        _check_precision(result, precision, steps=12)
        assert result["collective_steps"] == 12
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)


def _fit_in_16_mixed(rank: int, world_size: int) -> str:
    try:
        _trainer(strategy="single_xla", precision="16-mixed", max_epochs=1).fit(
            LinearModel(), loader(batch_size=16)
        )
    except ConfigurationError as err:
        return str(err)
    return "no error"


def test_16_mixed_is_refused_with_what_works_instead(tmp_path: Path) -> None:
    (message,) = run_xla_ranks(_fit_in_16_mixed, 1, tmp_path)
    assert "precision='16-mixed' needs CUDA's gradient scaler" in message
    assert "'bf16-true'" in message


@pytest.mark.parametrize("name", ["xla", "single_xla"])
def test_16_mixed_is_refused_when_the_trainer_is_built(name: str) -> None:
    # Before any rank starts, in the launching process.
    with pytest.raises(ConfigurationError, match="precision='16-mixed' needs CUDA's gradient"):
        _trainer(strategy=name, devices=2 if name == "xla" else 1, precision="16-mixed")


class FailsOnRankOne(LinearModel):
    """Rank 1 raises at batch 2 of the first epoch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2 and self.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        return super().training_step(batch, batch_idx)


def test_a_failing_rank_is_reported_by_rank() -> None:
    trainer = _trainer(strategy="xla", devices=2, max_epochs=1)
    with pytest.raises(RankFailureError, match="Rank 1 failed") as info:
        trainer.fit(FailsOnRankOne(), loader(batch_size=16))
    assert "rank 1 fails on purpose" in str(info.value)


class LateRankOne(LinearModel):
    """At batch 1, rank 1 sleeps ``seconds`` first: rank 0 reaches the step's all-reduce that
    long before it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == 1:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


def _late_fit(rank: int, world_size: int, model: LateRankOne, gradient_sync: str) -> torch.Tensor:
    trainer = _trainer(
        strategy=XLAStrategy(gradient_sync=gradient_sync),
        accelerator="xla",
        devices=world_size,
        max_epochs=1,
    )
    trainer.fit(model, loader(batch_size=16))
    return flat_weights(model).cpu()


@pytest.mark.parametrize("gradient_sync", ["native", "collective"])
def test_a_rank_far_behind_its_peer_is_waited_for(tmp_path: Path, gradient_sync: str) -> None:
    # XLA aborts a process whose devices reach one collective 15 s apart ("A process in the
    # process pool was terminated abruptly"); the ranks meet before it instead.
    # The model is built here: seeded in the ranks' threads, it would draw from one RNG.
    results = run_xla_ranks(_late_fit, 2, tmp_path, LateRankOne(16.0), gradient_sync)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[0], _cpu_weights(32, epochs=1), rtol=1e-4, atol=1e-5)


def test_names_are_registered() -> None:
    assert StrategyRegistry.get("xla").strategy_cls is XLAStrategy
    assert StrategyRegistry.get("single_xla").strategy_cls is SingleDeviceXLAStrategy


# ------------------------------------------------------------------ assert_strategies_agree
class AgreeNet(accord.Module):
    """Two layers and plain SGD, for `assert_strategies_agree` (importable by the ranks).

    Plain SGD: with an optimizer that keeps state (SGD with momentum, Adam), "xla" at two
    devices of the CPU runtime with gradient_sync="native" stops in XLA's all-reduce
    rendezvous from the second or third step on ("Expected 2 threads to join the
    rendezvous", then the process pool dies); gradient_sync="collective" trains it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def agree_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(-1) + 0.1 * torch.randn(32, generator=generator))


def xla_collective_sync() -> XLAStrategy:
    """The "xla" strategy, its gradients sent through its collective's all_reduce."""
    return XLAStrategy(gradient_sync="collective")


def test_xla_strategies_agree_with_one_device() -> None:
    # "xla" runs its launcher (xmp.spawn, two devices of the CPU runtime) from this process;
    # "single_xla" needs a process of its own (Strategy.needs_own_process), which the kit
    # starts, so the runtime never starts here. accelerator="auto" lets the XLA strategies
    # bring their own accelerator while single_device trains on the CPU. float32 on XLA's
    # CPU runtime agrees within the default tolerances (its losses differ from the CPU's
    # by about 1e-7, relative), so none are loosened.
    strategies = ["xla", "single_xla", xla_collective_sync]
    records = assert_strategies_agree(AgreeNet, agree_data, strategies, steps=4, accelerator="auto")
    assert list(records) == ["single_device", "xla", "single_xla", "xla_collective_sync"]
    assert records["xla"].samples == [list(range(8 * k, 8 * k + 8)) for k in range(4)]


# ------------------------------------------------- checkpoints between strategies
# tests/reliability/test_resume_matrix.py's fit: 96 samples in a global batch of 24 (2
# ranks x 12 under "xla", 24 on one CPU device), Adam with an LR halved every epoch, 3
# epochs; saved half-way through epoch 1 (step 6 of 12, by ModelCheckpoint(
# every_n_train_steps=6)) under one strategy and resumed under the other. The resumed fit
# ends with the uninterrupted run's weights, and the samples seen before and after the
# save are the uninterrupted run's. "xla" sends its gradients through its collective
# (gradient_sync="collective"): with Adam's state the native sync stops in XLA's
# all-reduce rendezvous at two devices of the CPU runtime (see AgreeNet).
#
# Every fit's module is built here, in the test process, and handed to the ranks, as
# Trainer.fit hands it to XLALauncher. The ranks are threads of one process sharing
# torch's CPU generator: a module seeded and built in each rank draws its initial weights
# while the other rank reseeds and draws, so rank 0 (whose weights sync_module_states
# gives every rank) now and then starts from weights no seed gives.
MOVE_SAMPLES, MOVE_BATCH, MOVE_EPOCHS, MOVE_SAVE_STEP = 96, 24, 3, 6


class Recorder(accord.Module):
    """Two linear layers trained with Adam (LR halved every epoch); records each sample's
    index with the epoch it was trained in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 13), torch.nn.Tanh(), torch.nn.Linear(13, 1)
        )
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        epoch = self.trainer.current_epoch
        self.seen.extend((epoch, int(i)) for i in index.tolist())
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


def _move_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(MOVE_SAMPLES, 8, generator=generator)
    y = x.sum(dim=1) + 0.1 * torch.randn(MOVE_SAMPLES, generator=generator)
    return torch.utils.data.TensorDataset(x, y, torch.arange(MOVE_SAMPLES))


def _cpu_state(model: Recorder) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()}


def _move_fit(
    rank: int,
    world_size: int,
    model: Recorder,
    save: str | None = None,
    ckpt_path: str | None = None,
) -> dict[str, Any]:
    """``model``'s fit under "xla" on ``world_size`` ranks (0: single_device on the CPU, in
    this process); with ``save``, stopped at step 6 where ``save/saved.ckpt`` was written."""
    if world_size:
        devices = {"strategy": XLAStrategy(gradient_sync="collective"), "accelerator": "xla"}
    else:
        devices = {"strategy": "single_device", "accelerator": "cpu"}
    saving = ModelCheckpoint(dirpath=save, filename="saved", every_n_train_steps=MOVE_SAVE_STEP)
    trainer = _trainer(
        devices=max(world_size, 1),
        max_epochs=MOVE_EPOCHS,
        max_steps=MOVE_SAVE_STEP if save else -1,
        enable_checkpointing=save is not None,
        callbacks=[saving] if save else [],
        **devices,
    )
    start = _cpu_state(model)
    data = torch.utils.data.DataLoader(_move_data(), batch_size=MOVE_BATCH // max(world_size, 1))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {
        "start": start,
        "weights": _cpu_state(model),
        "seen": model.seen,
        "global_step": trainer.global_step,
    }


def _same_fit(
    resumed: list[dict[str, Any]], saved: list[dict[str, Any]], full: dict[str, Any]
) -> None:
    for run in saved:
        for key, value in full["start"].items():
            torch.testing.assert_close(run["start"][key], value, rtol=0, atol=0)
    seen = [pair for run in saved + resumed for pair in run["seen"]]
    assert sorted(seen) == sorted(full["seen"])
    before = [epoch for run in saved for epoch, _ in run["seen"]]
    assert (before.count(0), before.count(1)) == (MOVE_SAMPLES, MOVE_SAMPLES // 2)
    for run in resumed:
        assert run["global_step"] == full["global_step"] == 12
        assert run["weights"].keys() == full["weights"].keys()
        for key, value in full["weights"].items():
            torch.testing.assert_close(run["weights"][key], value, rtol=1e-5, atol=1e-5)


def test_an_xla_checkpoint_resumes_on_one_cpu_device(tmp_path: Path) -> None:
    full = _move_fit(0, 0, Recorder())
    saved = run_xla_ranks(_move_fit, 2, tmp_path / "ranks", Recorder(), str(tmp_path / "saved"))
    checkpoint = tmp_path / "saved" / "saved.ckpt"
    described = describe_checkpoint(checkpoint)
    assert (described["strategy"], described["world_size"]) == ("XLAStrategy", 2)
    assert (described["global_step"], described["samples_consumed"]) == (MOVE_SAVE_STEP, 48)
    resumed = _move_fit(0, 0, Recorder(), ckpt_path=str(checkpoint))
    _same_fit([resumed], saved, full)


def test_a_cpu_checkpoint_resumes_under_xla(tmp_path: Path) -> None:
    full = _move_fit(0, 0, Recorder())
    saved = _move_fit(0, 0, Recorder(), save=str(tmp_path / "saved"))
    checkpoint = str(tmp_path / "saved" / "saved.ckpt")
    resumed = run_xla_ranks(_move_fit, 2, tmp_path / "ranks", Recorder(), None, checkpoint)
    _same_fit(resumed, [saved], full)
