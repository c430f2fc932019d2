"""``precision="bf16-true"`` (and ``"16-true"``) on every strategy: a float32 dataset trains.

The parameters take the mode's dtype when the strategy sets the module up, and each batch's
floating-point tensors are converted on their way to the step, so an ordinary float32
`TensorDataset` trains, with accumulation and clipping, as it does in fp32. Multi-rank fits
run in real processes over gloo (`run_distributed`); the ranks' weights must agree exactly.
Where a backend cannot run a mode, the Trainer says so when it is built. (Horovod and XLA
have their own lanes: ``test_horovod.py`` and ``test_xla.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import accord
from accord.errors import ConfigurationError
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, loader

TIMEOUT = 240.0  # a DeepSpeed job may compile DeepSpeed's extension first (see test_deepspeed)

# What every fit here shares: the setting of the bug report, with accumulation and clipping.
SETTINGS: dict[str, Any] = {
    "accelerator": "cpu",
    "accumulate_grad_batches": 2,
    "gradient_clip_val": 0.5,
    "max_epochs": 3,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
}


class DtypeRecorder(LinearModel):
    """`LinearModel` that records the dtypes of the batches its steps receive."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_dtypes: set[torch.dtype] = set()
        self.ddp_buckets: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_dtypes.update(t.dtype for t in batch)
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        wrapper = self.trainer.model_wrapper
        if isinstance(wrapper, DistributedDataParallel):
            sizes = wrapper._get_ddp_logging_data()["bucket_sizes"]
            self.ddp_buckets = len(str(sizes).split(","))


def _weights(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one vector; FSDP's shards are gathered (collective)."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in full])


def _fit(strategy: str, **kwargs: Any) -> dict[str, Any]:
    model = DtypeRecorder()
    trainer = accord.Trainer(strategy=strategy, **{**SETTINGS, **kwargs})
    trainer.fit(model, loader(batch_size=16), loader(batch_size=64))
    return {
        "ddp_buckets": model.ddp_buckets,
        "weights": _weights(model),
        "param_dtypes": {p.dtype for p in model.parameters()},
        "batch_dtypes": model.batch_dtypes,
        "losses": model.losses,
        "steps": trainer.global_step,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


# The dtype of the parameters and of the batches the step receives: the true modes convert
# both, bf16-mixed keeps them in float32 and computes under autocast.
DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "bf16-mixed": torch.float32}
TRUE_MODES = ("bf16-true", "16-true")


def _check(result: dict[str, Any], precision: str, steps: int) -> None:
    assert result["param_dtypes"] == {DTYPES[precision]}
    assert result["batch_dtypes"] == {DTYPES[precision]}
    assert result["steps"] == steps
    # Clipped at 0.5 with lr 0.1, a step moves the weights by 0.05 at most: the descent is
    # slow but steady (about 25% from the first epoch to the third on two ranks).
    losses = result["losses"]
    per_epoch = len(losses) // SETTINGS["max_epochs"]
    first, last = sum(losses[:per_epoch]), sum(losses[-per_epoch:])
    assert last < 0.85 * first, losses


def _check_ranks(results: list[dict[str, Any]], precision: str) -> None:
    # 256 samples, 8 batches of 16 per rank and epoch, accumulated in pairs, 3 epochs.
    for result in results:
        _check(result, precision, steps=12)
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
        assert result["val_loss"] == results[0]["val_loss"]


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("strategy", ["single_device", "dp"])
@pytest.mark.filterwarnings("ignore:strategy='dp' on CPU runs one replica")
def test_one_process_strategies(strategy: str, precision: str) -> None:
    _check(_fit(strategy, devices=1, precision=precision), precision, steps=24)


def _ddp_and_fsdp(rank: int, world_size: int) -> dict[str, Any]:
    # The test owns the group and the strategies join it: it outlives each fit, so
    # FSDP's sharded weights can be gathered afterwards, and both fits share one launch.
    dist.init_process_group("gloo")
    try:
        return {
            (name, precision): _fit(name, devices=world_size, precision=precision)
            for name in ("ddp", "fsdp")
            for precision in TRUE_MODES
        }
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_and_fsdp() -> list[dict[str, Any]]:
    """The ddp and fsdp fits of the tests below, in one pair of processes."""
    return run_distributed(_ddp_and_fsdp, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("precision", TRUE_MODES)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks(ddp_and_fsdp: list[dict[str, Any]], strategy: str, precision: str) -> None:
    results = [result[strategy, precision] for result in ddp_and_fsdp]
    _check_ranks(results, precision)
    if strategy == "ddp":
        # The step decision's slots take the parameters' dtype, so they ride in the one
        # gradient bucket (DDP buckets per dtype) instead of an all-reduce of their own.
        assert [result["ddp_buckets"] for result in results] == [1, 1]


def _deepspeed(rank: int, world_size: int) -> dict[str, Any]:
    return _fit("deepspeed_stage_2", devices=world_size, precision="bf16-true")


def test_deepspeed_stage_2_two_ranks() -> None:
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    _check_ranks(run_distributed(_deepspeed, 2, timeout=TIMEOUT), "bf16-true")


def test_deepspeed_16_true_on_cpu_is_refused_when_built() -> None:
    # DeepSpeed's fp16 engine raises "Type fp16 is not supported on your device" on CPU,
    # only once every rank has started; the Trainer refuses it before anything starts.
    pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    with pytest.raises(ConfigurationError, match=r"DeepSpeed.*fp16.*CUDA.*'bf16-true'"):
        accord.Trainer(strategy="deepspeed_stage_2", devices=2, precision="16-true", **SETTINGS)
