"""What `DebugCollective` compares and reports: call fingerprints and mismatch messages.

Holds the fixed tables a fingerprint is built from (op, reduce op and dtype ids, the field
layout), its digest, what a kind of call is (`call_kind`), the hashing of call sites, the
stack walk that finds the accord line behind a call, and the text of a
`CollectiveMismatchError` (what each rank called and where the calls differ).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import zlib
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch

from accord.core.collective import ReduceOp, ReduceOpLike
from accord.core.reduce_op import OP_SPELLINGS
from accord.core.wrappers.wrapper import CallSite, OpCall, call_site

# The group operations, in a fixed order: a fingerprint carries the index, never a name.
_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "gather",
    "scatter",
    "all_to_all",
    "broadcast_object",
    "all_gather_object",
    "send/recv",
)
_OP_IDS = {name: index + 1 for index, name in enumerate(_OPS)}
_OP_IDS["send"] = _OP_IDS["recv"] = _OP_IDS["send/recv"]
_TENSOR_OPS = frozenset(
    {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"}
)
_REDUCE_IDS = {member: index + 1 for index, member in enumerate(ReduceOp)}
_DTYPE_IDS = {
    dtype: index + 1
    for index, dtype in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    )
}

# Fingerprint layout: op, reduce op / src / dst, peer, dtype, ndim, shape hash, call count,
# call site hash, barrier name hash. The first _DEFAULT_FIELDS are always compared; the call
# site and barrier name only with compare_call_sites=True, since `if rank == 0:
# broadcast(x) else: broadcast(y)` is correct code that calls from two lines.
_DEFAULT_FIELDS = 7
_STRICT_FIELDS = 9
_COUNT = 6  # the call count's index
_NONE = -1
_INVALID = -2


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _digest(values: Sequence[int]) -> int:
    """A 56-bit digest of ``values``: a call's compared fields but its count."""
    packed = struct.pack(f"<{len(values)}q", *values)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


_MASK64 = (1 << 64) - 1


def _mixed(seed: int, count: int) -> int:
    """A 64-bit digest of a call: its fields' `_digest` and its count, through splitmix64's
    finaliser, so that calls differing only in their count land far apart (the check's
    wire keeps the top bits)."""
    z = (seed + count * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# The layers between a caller and this check. A report's "via" is the first accord frame
# past them: the strategy helper, or DDP's gradient bucket hook, that made the call.
_PLUMBING = ("accord.core.wrappers", "accord.core.collective", "accord.collectives")


def _where() -> tuple[CallSite, CallSite | None]:
    """`call_site`'s ``site``, and the innermost accord frame outside the plumbing as ``via``."""
    site, _ = call_site()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not isinstance(module, str) or not module.startswith("accord."):
            break
        if module.startswith("accord.testing"):
            break
        if not module.startswith(_PLUMBING):
            code = frame.f_code
            return site, CallSite(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return site, None


def _site_hash(site: CallSite) -> int:
    # The file's base name, so ranks with different install paths still agree.
    return _crc(f"{site.filename.rsplit(os.sep, 1)[-1]}:{site.lineno}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _format_call(description: dict[str, Any]) -> str:
    parts = []
    if description["shape"] is not None:
        parts.append(f"shape={tuple(description['shape'])}")
    if description["dtype"] is not None:
        parts.append(f"dtype={description['dtype']}")
    parts.extend(description["arguments"])
    if description["name"] is not None:
        parts.append(f"name={description['name']!r}")
    line = (
        f"  rank {description['rank']}: {description['op']}({', '.join(parts)}) "
        f"[call #{description['call']}] at {description['site']}"
    )
    if description["via"]:
        line += f" (via {description['via']})"
    if description["error"]:
        line += f"; invalid there: {description['error']}"
    return line


_COMPARED = (
    ("op", "op"),
    ("shape", "shape"),
    ("dtype", "dtype"),
    ("arguments", "reduce op / src / dst"),
    ("call", "call count"),
)
_COMPARED_STRICT = (("site", "call site"), ("name", "barrier name"))


def _mismatch_message(descriptions: Sequence[dict[str, Any]], strict: bool) -> str:
    fields = _COMPARED + _COMPARED_STRICT if strict else _COMPARED
    differing = [
        label for key, label in fields if len({repr(d[key]) for d in descriptions}) > 1
    ] or ["their arguments"]
    lines = "\n".join(_format_call(d) for d in descriptions)
    return (
        f"Collective mismatch: the ranks' calls differ in {', '.join(differing)}. Nothing "
        f"was sent, and every rank involved raises this error:\n{lines}\n"
        "Every rank must make the same collective calls, with the same shapes, dtypes and "
        "src/dst/reduce op, in the same order."
    )


_SHAPE_IDS: dict[torch.Size, int] = {}


def shape_id(shape: torch.Size) -> int:
    """The fingerprint's shape field: a CRC of the shape, remembered for the shapes seen."""
    found = _SHAPE_IDS.get(shape)
    if found is None:
        if len(_SHAPE_IDS) > 4096:
            _SHAPE_IDS.clear()
        found = _SHAPE_IDS[shape] = _crc(repr(tuple(shape)))
    return found


def parsed_op(op: ReduceOpLike) -> ReduceOp:
    """`ReduceOp.parse`, with the exact spellings looked up first (as `Collective` does)."""
    found = OP_SPELLINGS.get(op) if isinstance(op, str) else None
    return ReduceOp.parse(op) if found is None else found


def call_kind(call: OpCall) -> tuple[Any, ...] | None:
    """What a tensor call's check depends on besides its count: the op, its arguments and
    the tensor's type, dtype, shape, layout and device. None for calls without a tensor."""
    tensor = call.tensor
    if not isinstance(tensor, torch.Tensor):
        return None
    return (
        call.op,
        call.reduce_op,
        call.root,
        call.label,
        type(tensor),
        tensor.dtype,
        tensor.shape,
        tensor.layout,
        tensor.device,
    )
