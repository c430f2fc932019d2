"""True-precision modes (``bf16-true``, ``16-true``): the batch takes the module's dtype.

The parameters are converted once, when the strategy sets the module up; every batch's
floating-point tensors are converted on their way to the step, in `Strategy.batch_to_device`
through `Precision.convert_input`, so a float32 `TensorDataset` trains as it does in fp32.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

import accord
from accord.precision import Precision, PrecisionMode
from accord.strategies import SingleDeviceStrategy
from tests.helpers.models import LinearModel, loader

Pair = namedtuple("Pair", ["features", "index"])


def _batch() -> dict[str, Any]:
    return {
        "x": torch.ones(2, 3),
        "nested": [(torch.zeros(2, dtype=torch.float64), torch.arange(2)), "text", None],
        "mask": torch.tensor([True, False]),
        "pair": Pair(torch.ones(1, dtype=torch.float16), torch.tensor([7], dtype=torch.int32)),
        "ordered": OrderedDict(y=torch.ones(1)),
    }


def test_16_true_is_a_mode() -> None:
    assert PrecisionMode.parse("16-true") is PrecisionMode.FP16_TRUE
    assert PrecisionMode.parse(" 16-True ") is PrecisionMode.FP16_TRUE
    assert str(PrecisionMode.FP16_TRUE) == "16-true"


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("32-true", None),
        ("bf16-mixed", None),
        ("16-mixed", None),
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
    ],
)
def test_only_true_modes_convert_inputs(mode: str, dtype: torch.dtype | None) -> None:
    precision = Precision(mode)
    assert precision.input_dtype is dtype
    assert precision.param_dtype is dtype


@pytest.mark.parametrize(
    ("mode", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)]
)
def test_floating_tensors_take_the_dtype_and_the_rest_is_untouched(
    mode: str, dtype: torch.dtype
) -> None:
    batch = _batch()
    out = Precision(mode).convert_input(batch)
    assert type(out) is dict
    assert out["x"].dtype is dtype and torch.equal(out["x"], batch["x"].to(dtype))
    floats, index = out["nested"][0]
    assert type(out["nested"]) is list and type(out["nested"][0]) is tuple
    assert floats.dtype is dtype
    # Integer and bool tensors are the very same objects: no copy, no cast.
    assert index is batch["nested"][0][1]
    assert out["mask"] is batch["mask"]
    assert out["nested"][1:] == ["text", None]
    assert type(out["pair"]) is Pair
    assert out["pair"].features.dtype is dtype
    assert out["pair"].index is batch["pair"].index
    assert type(out["ordered"]) is OrderedDict and out["ordered"]["y"].dtype is dtype
    # The input batch is not modified.
    assert batch["x"].dtype is torch.float32


def test_a_tensor_already_in_the_dtype_is_not_copied() -> None:
    tensor = torch.ones(3, dtype=torch.bfloat16)
    assert Precision("bf16-true").convert_input(tensor) is tensor


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed"])
def test_other_modes_return_the_batch_itself(mode: str) -> None:
    batch = _batch()
    assert Precision(mode).convert_input(batch) is batch


def test_batch_to_device_converts_in_true_modes_only() -> None:
    batch = (torch.ones(4, 3), torch.arange(4))
    true = SingleDeviceStrategy(precision=Precision("bf16-true")).batch_to_device(batch)
    assert [t.dtype for t in true] == [torch.bfloat16, torch.int64]
    assert true[1] is batch[1]
    # 32-true: the tensors (already on the device) come back as they are, not copied.
    plain = SingleDeviceStrategy().batch_to_device(batch)
    assert plain[0] is batch[0] and plain[1] is batch[1]


@pytest.mark.parametrize(
    ("mode", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)]
)
def test_a_float32_dataset_trains_in_a_true_mode(mode: str, dtype: torch.dtype) -> None:
    model = LinearModel()
    trainer = accord.Trainer(
        strategy="single_device",
        accelerator="cpu",
        precision=mode,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16), loader(batch_size=64))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert trainer.global_step == 16
    half = len(model.losses) // 2
    assert sum(model.losses[half:]) < 0.8 * sum(model.losses[:half])
    assert "val_loss" in trainer.callback_metrics
    predictions = trainer.predict(model, loader(batch_size=64))
    assert {p.dtype for p in predictions} == {dtype}
