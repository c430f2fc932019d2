"""What `DebugCollective` compares across ranks, and what it reports when they differ.

A call's fingerprint is a list of integers, one per field (`FIELDS`): the op, its reduce op
or root, the peer of a point-to-point call, the tensor's dtype, number of dimensions and
shape, the call's count and, compared only in strict mode, its call site and barrier name.
`fingerprint` computes it; `fields_digest` hashes the compared fields but the count once
per kind of call (`call_kind`), and `call_digest` adds the count per call, so the check
sends one 64-bit number. When the ranks disagree, each describes its call (`describe_call`,
with `find_call_site` for the user's line and the accord line it came through) and
`mismatch_message` turns every rank's description into the text of a
`CollectiveMismatchError`.

This module is public so that other checks (a test, a tool reading dumps) can compute the
same fingerprints; the layout of `FIELDS` is fixed for a release.
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

__all__ = [
    "DEFAULT_FIELDS",
    "DTYPE_IDS",
    "FIELDS",
    "STRICT_FIELDS",
    "TENSOR_OPS",
    "call_digest",
    "call_kind",
    "describe_call",
    "fields_digest",
    "find_call_site",
    "fingerprint",
    "mismatch_message",
    "parsed_op",
    "shape_id",
]

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
TENSOR_OPS = frozenset(
    {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"}
)
"""The group operations whose argument must be a tensor."""
_REDUCE_IDS = {member: index + 1 for index, member in enumerate(ReduceOp)}
DTYPE_IDS = {
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

FIELDS = ("op", "argument", "peer", "dtype", "ndim", "shape", "count", "site", "label")
"""A fingerprint's fields, in order: the op, the reduce op or src/dst, the peer of a
point-to-point call, the tensor's dtype, dimensions and shape hash, the call's count, the
call site's hash and the barrier name's hash."""

DEFAULT_FIELDS = 7
"""How many leading fields are compared by default (through the count). The call site and
barrier name only count with ``compare_call_sites=True``, since ``if rank == 0:
broadcast(x) else: broadcast(y)`` is correct code that calls from two lines."""

STRICT_FIELDS = 9
"""How many fields are compared in strict mode: all of them."""

_COUNT = FIELDS.index("count")
_NONE = -1
_INVALID = -2


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def fields_digest(values: Sequence[int], strict: bool) -> int:
    """A 56-bit digest of a `fingerprint`'s compared fields but its count (the same for
    every call of one kind; `call_digest` adds the count)."""
    compared = [*values[:_COUNT], *values[_COUNT + 1 : STRICT_FIELDS if strict else DEFAULT_FIELDS]]
    packed = struct.pack(f"<{len(compared)}q", *compared)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


_MASK64 = (1 << 64) - 1


def call_digest(seed: int, count: int) -> int:
    """A 64-bit digest of a call: its `fields_digest` and its count, through splitmix64's
    finaliser, so that calls differing only in their count land far apart (the check
    keeps the top bits)."""
    z = (seed + count * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# The layers between a caller and this check. A report's "via" is the first accord frame
# past them: the strategy helper, or DDP's gradient bucket hook, that made the call.
_PLUMBING = ("accord.core.wrappers", "accord.core.collective", "accord.collectives")


def find_call_site() -> tuple[CallSite, CallSite | None]:
    """Where the call being checked came from: `call_site`'s ``site`` (the user's line), and
    the innermost accord frame outside the collective plumbing as ``via``."""
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


def fingerprint(
    call: OpCall, rank: int, site: CallSite | None, count: int
) -> tuple[list[int], ReduceOp | None]:
    """The fingerprint of ``call`` on ``rank`` (one integer per field of `FIELDS`), and its
    reduce op, parsed (None without one, or when it does not parse).

    ``site`` is the call site for strict mode (None: not compared); ``count`` the call's
    number (0 for `fields_digest`, which leaves the count out). A value that is invalid (a
    reduce op that does not parse, a root that is not an int, an argument that is not a
    tensor) gets a field of its own, so ranks that disagree still differ.
    """
    tensor = call.tensor
    argument = peer = _NONE
    reduce = None
    if call.reduce_op is not None:
        try:
            reduce = parsed_op(call.reduce_op)
            argument = _REDUCE_IDS[reduce]
        except ValueError:
            argument = _INVALID
    if call.root is not None:
        argument = call.root if _is_int(call.root) else _INVALID
    if call.is_point_to_point:
        # Both ends describe the same transfer: (source, destination).
        argument, peer = (rank, call.root) if call.op == "send" else (call.root, rank)
    if isinstance(tensor, torch.Tensor):
        dtype = DTYPE_IDS.get(tensor.dtype) or _crc(str(tensor.dtype))
        ndim = tensor.dim()
        shape = shape_id(tensor.shape)
    else:
        dtype = _NONE if tensor is None else _INVALID
        ndim = shape = _NONE
    label = _crc(call.label) if call.label else _NONE
    site_hash = _NONE if site is None else _site_hash(site)
    return [_OP_IDS[call.op], argument, peer, dtype, ndim, shape, count, site_hash, label], reduce


def describe_call(
    call: OpCall,
    rank: int,
    site: CallSite,
    via: CallSite | None,
    count: int,
    error: Exception | None,
) -> dict[str, Any]:
    """What ``call`` was on ``rank``, for a mismatch report: ``rank``, ``call`` (its count),
    ``op``, ``shape``, ``dtype``, ``arguments``, ``name``, ``site``, ``via`` and ``error``
    (what is invalid about it, if anything)."""
    tensor = call.tensor
    if isinstance(tensor, torch.Tensor):
        shape: list[int] | None = list(tensor.shape)
        dtype: str | None = str(tensor.dtype)
    else:
        shape = None
        dtype = None if tensor is None else f"not a tensor ({type(tensor).__name__})"
    arguments: list[str] = []
    if call.reduce_op is not None:
        try:
            arguments.append(f"op={ReduceOp.parse(call.reduce_op).value}")
        except ValueError:
            arguments.append(f"op={call.reduce_op!r}")
    if call.root is not None:
        role = "dst" if call.op in ("gather", "send") else "src"
        arguments.append(f"{role}={call.root!r}")
    return {
        "rank": rank,
        "call": count,
        "op": call.op,
        "shape": shape,
        "dtype": dtype,
        "arguments": arguments,
        "name": call.label,
        "site": str(site),
        "via": None if via is None else str(via),
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }


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


def mismatch_message(descriptions: Sequence[dict[str, Any]], strict: bool) -> str:
    """The text of a `CollectiveMismatchError`: which fields differ, and each rank's call
    (`describe_call`) in rank order."""
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
