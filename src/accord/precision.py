"""`Precision`: the Trainer's ``precision=`` as autocast, gradient scaling and dtypes.

In the true-precision modes (``bf16-true``, ``16-true``) the module's parameters are
converted once, when the strategy sets it up, and the floating-point tensors of every batch
are converted on their way to the step (`Precision.convert_input`, called from
``Strategy.batch_to_device``), so an ordinary float32 dataset meets parameters of its own
dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from accord.errors import ConfigurationError, did_you_mean

__all__ = ["Precision", "PrecisionMode"]


class PrecisionMode(str, Enum):
    """The precision settings accord supports."""

    TRUE_32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | int | PrecisionMode) -> PrecisionMode:
        """Accept the names above plus Lightning's short forms (32, "32", 16, "bf16")."""
        if isinstance(value, PrecisionMode):
            return value
        text = str(value).strip().lower()
        aliases = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
        key = aliases.get(text, text)
        for mode in cls:
            if mode.value == key:
                return mode
        names = [mode.value for mode in cls]
        raise ConfigurationError(
            f"Unknown precision {value!r}.{did_you_mean(text, names)} Use one of {names}."
        )


class Precision:
    """Runs forward passes under autocast and scales fp16 losses.

    Args:
        mode: one of `PrecisionMode` (or its name).
        device: where the model runs; autocast is set up for its device type.
    """

    def __init__(self, mode: str | int | PrecisionMode = "32-true", device: Any = "cpu") -> None:
        self.mode = PrecisionMode.parse(mode)
        self.device_type = torch.device(device).type
        self.scaler: torch.amp.GradScaler | None = None
        self._unscaled: set[int] = set()
        if self.mode is PrecisionMode.FP16_MIXED:
            self.scaler = torch.amp.GradScaler(self.device_type)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in, or None when there is no autocast."""
        return _AUTOCAST_DTYPES.get(self.mode)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are converted to, or None to keep them as they are."""
        return _TRUE_DTYPES.get(self.mode)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The dtype `convert_input` gives floating-point batch tensors, or None to keep them.

        The true modes compute in the parameters' dtype, so the batch must match it; the
        mixed modes leave the batch to autocast.
        """
        return _TRUE_DTYPES.get(self.mode)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Convert parameters where the mode asks for it (``bf16-true``, ``16-true``)."""
        return module.to(self.param_dtype) if self.param_dtype is not None else module

    def convert_input(self, batch: Any) -> Any:
        """Cast the floating-point tensors of a nested batch to `input_dtype`.

        Lists, tuples, named tuples and dicts keep their types; integer and bool tensors,
        tensors already in the dtype and anything else are passed through as they are.
        Where `input_dtype` is None the batch itself is returned, with no walk over it.
        """
        dtype = self.input_dtype
        return batch if dtype is None else _cast_floating(batch, dtype)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for the mixed modes; a no-op context otherwise."""
        dtype = self.autocast_dtype
        if dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(
        self, loss: torch.Tensor, backward_fn: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """``loss.backward()``, scaled in fp16 mode; ``backward_fn`` (a module's own
        ``backward``) runs it instead when given."""
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        if backward_fn is None:
            scaled.backward()  # type: ignore[no-untyped-call]
        else:
            backward_fn(scaled)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo the loss scale on ``optimizer``'s gradients (before the hooks see them and
        clipping); a second call before the step does nothing."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None
    ) -> None:
        """Step ``optimizer``; in fp16 mode a step with inf/nan gradients is skipped.

        ``closure`` goes to an optimizer that needs one (LBFGS); with a loss scaler it runs
        once first, as the scaler cannot step with a closure.
        """
        if self.scaler is None:
            if closure is None:
                optimizer.step()
            else:
                optimizer.step(closure)
            return
        if closure is not None:
            closure()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty when there is none)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Precision({self.mode.value!r})"


_TRUE_DTYPES = {PrecisionMode.BF16_TRUE: torch.bfloat16, PrecisionMode.FP16_TRUE: torch.float16}
_AUTOCAST_DTYPES = {
    PrecisionMode.BF16_MIXED: torch.bfloat16,
    PrecisionMode.FP16_MIXED: torch.float16,
}
# Entered once per step when there is no autocast; a nullcontext can be re-entered.
_NO_AUTOCAST = contextlib.nullcontext()


def _cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(
        batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t
    )
