"""`CallRecord`, one recorded collective call, and how a recorder finds the call's site.

Holds the record type `RecordingCollective` keeps in its ring buffer, the stack walk that
names the user's line (and the accord line that made the call on its behalf), and the
state a failed call is recorded with. Re-exported from `accord.core.wrappers.recorder`.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any

import torch

from accord.core.wrappers.wrapper import CallSite, OpCall
from accord.errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["CallRecord"]

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class CallRecord:
    """One collective call on one rank.

    Attributes:
        seq: the call's number among this rank's group operations (1, 2, ...); equal on
            every rank for the same call. ``None`` for ``send``/``recv``.
        op: the operation's name.
        shape: the tensor's shape (None for barrier and object ops).
        dtype: the tensor's dtype, as text (None without a tensor).
        nbytes: bytes handed in (0 without a tensor).
        arg: the reduce op, ``src`` or ``dst`` as text (None where the op has none).
        label: the barrier's name.
        start: ``time.perf_counter()`` when the call began.
        end: when it returned or raised (None while it runs).
        site: the first frame outside accord (the user's line).
        via: the accord frame that made the call on the user's behalf, if any.
        step: the training step, when a step source was given.
        state: ``"running"``, ``"ok"``, ``"failed"``, or what ended the run
            (``"timeout"``, ``"abandoned"``, ``"mismatch"``).
    """

    __slots__ = (
        "arg",
        "dtype",
        "end",
        "label",
        "nbytes",
        "op",
        "seq",
        "shape",
        "site",
        "start",
        "state",
        "step",
        "via",
    )

    def __init__(
        self,
        seq: int | None,
        call: OpCall,
        site: CallSite,
        via: CallSite | None,
        step: int | None,
        start: float,
    ) -> None:
        self.seq = seq
        self.op = call.op
        tensor = call.tensor
        if isinstance(tensor, torch.Tensor):
            self.shape: tuple[int, ...] | None = tuple(tensor.shape)
            self.dtype: str | None = _DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype)
            self.nbytes = tensor.numel() * tensor.element_size()
        else:
            self.shape = self.dtype = None
            self.nbytes = 0
        argument = call.reduce_op if call.reduce_op is not None else call.root
        self.arg = None if argument is None else str(getattr(argument, "value", argument))
        self.label = call.label
        self.site = site
        self.via = via
        self.step = step
        self.start = start
        self.end: float | None = None
        self.state = "running"

    def as_dict(self, offset: float = 0.0) -> dict[str, Any]:
        """The record as JSON-ready values; ``offset`` is subtracted from the times."""
        return {
            "seq": self.seq,
            "op": self.op,
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
            "arg": self.arg,
            "label": self.label,
            "start": self.start - offset,
            "end": None if self.end is None else self.end - offset,
            "site": str(self.site),
            "via": None if self.via is None else str(self.via),
            "step": self.step,
            "state": self.state,
        }

    def __repr__(self) -> str:
        return f"CallRecord(#{self.seq} {self.op} {self.state} at {self.site})"


# Frames that only pass a call along: never named as the accord line that made it.
_PLUMBING = ("accord.core.wrappers", "accord.core.collective", "accord.core.buffers",
             "accord.core.objects", "accord.core.strategy", "accord.collectives")  # fmt: skip
_UNKNOWN = CallSite("<unknown>", 0, "<unknown>")


_OUTSIDE, _PASSING, _ACCORD = 0, 1, 2
# What each code object on a call's way is: looked up once per function, not per call.
_KINDS: dict[CodeType, int] = {}


def _kind(frame: FrameType) -> int:
    module = frame.f_globals.get("__name__", "")
    if not isinstance(module, str):
        module = ""
    own = module == "accord" or module.startswith("accord.")
    if not own or module.startswith("accord.testing"):
        kind = _OUTSIDE
    else:
        kind = _PASSING if module.startswith(_PLUMBING) else _ACCORD
    _KINDS[frame.f_code] = kind
    return kind


def _call_site() -> tuple[CallSite, CallSite | None]:
    """The first frame outside accord (accord.testing counts as outside), and the
    innermost accord frame on the way that is not collective plumbing (or None)."""
    frame: FrameType | None = sys._getframe(2)
    via: CallSite | None = None
    kinds = _KINDS
    while frame is not None:
        kind = kinds.get(frame.f_code)
        if kind is None:
            kind = _kind(frame)
        if kind == _OUTSIDE:
            return CallSite(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name), via
        if via is None and kind == _ACCORD:
            via = CallSite(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return via or _UNKNOWN, None


def _state_of(error: BaseException, rank: int) -> str:
    if isinstance(error, CollectiveTimeoutError):
        return "abandoned" if rank in error.missing_ranks else "timeout"
    if isinstance(error, CollectiveMismatchError):
        return "mismatch"
    return "failed"
