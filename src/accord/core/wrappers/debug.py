"""`DebugCollective`: catch ranks that call different collectives, before anything hangs.

When one rank calls ``all_reduce`` on a tensor of shape ``[2]`` and another on ``[3]`` (or
calls ``broadcast`` instead), a backend either hangs until its timeout or corrupts data.
`DebugCollective` wraps any collective and, before each operation, compares a fingerprint
of every rank's call (op, reduce op or src/dst, dtype, shape, a call counter and, in strict
mode, the calling line) through one small collective. If the fingerprints agree, the
operation runs as usual; if not, the ranks exchange full descriptions and every rank raises
`CollectiveMismatchError` naming what each rank called and from where. Nothing of the real
operation is used, so the group stays usable.

The comparison is one ``sum`` all-reduce of two float64 numbers per rank (no pickling; the
check buffer is in `accord.core.wrappers.debug_fold`, the fingerprint in
`accord.core.wrappers.debug_fingerprint`): a payload, and a digest of the fingerprint with a
bit saying whether the payload is in it. Every rank sends the same two numbers
whatever it calls, so ranks that disagree (another shape, another op) still meet in the
same collective, and every rank whose digest differs from the others' sees it in the sum.

A one-element ``sum`` or ``mean`` ``all_reduce`` and a one-element ``broadcast`` carry their
payload in the first number: once the fingerprints agree, the sum is the result, so the
call costs one round trip, the cost of the plain call, instead of two. The result is
exactly the backend's: only sums without an order (a float32 or float64 in a world of two,
integers that add exactly) fold, and a sum that is NaN, wraps an integer type or overflows
float32 is sent to the backend after all. Other ops, larger tensors and ``async_op=True``
send the check without a payload and then run the real operation; so does every rank when
any rank sent the call without its payload.

Turn it on for a whole run with ``ACCORD_DEBUG_COLLECTIVES=1`` (strategies wrap their
collective through `accord.core.wrappers.policy.maybe_debug`), or wrap a collective by hand.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from typing_extensions import Self, override

from accord.core.collective import Collective, ReduceOp, ReduceOpLike
from accord.core.wrappers.debug_fingerprint import (
    DEFAULT_FIELDS,
    STRICT_FIELDS,
    TENSOR_OPS,
    call_digest,
    call_kind,
    describe_call,
    fields_digest,
    find_call_site,
    fingerprint,
    mismatch_message,
    parsed_op,
)
from accord.core.wrappers.debug_fold import (
    CheckBuffer,
    fold_limit,
    folded_result,
    payload,
    spread,
)
from accord.core.wrappers.recorder import leave_trace
from accord.core.wrappers.wrapper import CallSite, CollectiveWrapper, OpCall, call_site
from accord.errors import CollectiveMismatchError

__all__ = ["DebugCollective"]

_T = TypeVar("_T")


class DebugCollective(CollectiveWrapper):
    """A collective that checks, before every operation, that all ranks called the same one.

    Each public operation (tensor ops, ``barrier``, object ops) is first compared across
    ranks by one ``sum`` all-reduce of two float64 numbers through the wrapped collective's
    primitives, no pickling. A one-element ``sum``/``mean`` ``all_reduce`` or
    ``broadcast`` travels in those numbers and is finished from their sum: one round trip
    in all, and the same result as the backend's. Other calls run after the check: one
    extra small collective per call. ``send``/``recv`` swap their 9-int fingerprint with
    the peer instead (two small point-to-point messages). On a difference every rank raises
    `CollectiveMismatchError` naming each rank's op, shape, dtype, arguments and calling
    ``file:line``; the real operation is not started. With a world of one there is nothing
    to compare and no extra traffic.

    A folded call still goes through the wrappers inside this one (a recorder records it,
    statistics count it); only its communication is this wrapper's own.

    Args:
        inner: the collective to check (any backend).
        compare_call_sites: also require every rank to call from the same source line
            (and barriers to have the same name). Off by default: correct code often calls
            the same collective from two branches.
    """

    def __init__(self, inner: Collective, *, compare_call_sites: bool = False) -> None:
        super().__init__(inner)
        self.compare_call_sites = compare_call_sites
        self._calls = 0
        self._peer_calls: dict[int, int] = {}
        self._device: torch.device | None = None  # object_device, looked up once per setup
        # What a valid kind of call contributes to the check, by `call_kind` (cleared at setup).
        self._seeds: dict[tuple[Any, ...], tuple[int, ReduceOp | None, int | None]] = {}
        # This rank, the world size, the wrappers inside this one and the check's reused
        # buffer, made on the first check after setup (`_find_place`).
        self._place: tuple[int, int, tuple[CollectiveWrapper, ...], CheckBuffer] | None = None

    @property
    @override
    def wants_engine_traffic(self) -> bool:
        """True: an engine's own traffic (DDP's gradient buckets) is checked like any call."""
        return True

    @property
    def calls_checked(self) -> int:
        """How many group operations this rank has called through this collective."""
        return self._calls

    def __getstate__(self) -> dict[str, Any]:
        # A copy of the check buffer would no longer share memory with its array.
        state = self.__dict__.copy()
        state["_device"] = state["_place"] = None
        return state

    @override
    def setup(self, **kwargs: Any) -> Self:
        self._device = self._place = None
        self._seeds = {}
        return super().setup(**kwargs)

    @override
    def teardown(self) -> Self:
        self._device = self._place = None
        self._seeds = {}
        return super().teardown()

    # ------------------------------------------------------- ops that can fold
    @override
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        out: torch.Tensor | None = None,
        **options: Any,
    ) -> Any:
        if options and (set(options) != {"async_op"} or options["async_op"]):
            # An asynchronous call: the check, then the inner collective's own handle.
            return super().all_reduce(tensor, op, out=out, **options)
        return self._check(
            OpCall("all_reduce", tensor, reduce_op=op),
            lambda: self._inner.all_reduce(tensor, op, out=out),
            out,
            fold=True,
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._check(
            OpCall("broadcast", tensor, root=src),
            lambda: self._inner.broadcast(tensor, src, out=out),
            out,
            fold=True,
        )

    @override
    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._check(
            OpCall("all_gather", tensor),
            lambda: self._inner.all_gather(tensor, out=out),
            out,
            fold=True,
        )

    # ------------------------------------------------------------------ the hook
    @override
    def _run(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        return self._check(call, perform, None, fold=False)

    def _check(
        self,
        call: OpCall,
        perform: Callable[[], _T],
        out: torch.Tensor | None,
        *,
        fold: bool,
    ) -> _T:
        """Compare ``call`` across ranks, then run it: folded into the check where it can be."""
        self._require_setup(call.op)
        if call.is_point_to_point:
            return self._run_point_to_point(call, perform)
        self._calls += 1
        rank, world_size, layers, buffer = self._place or self._find_place()
        if world_size == 1:
            return perform()
        # The calling line is only part of the fingerprint in strict mode; otherwise it is
        # looked up only to describe a mismatch.
        site = call_site()[0] if self.compare_call_sites else None
        seed, error, reduce, limit = self._seed(call, site, world_size)
        carried = None
        if fold and limit is not None:
            carried = payload(call, limit, rank)
        agreed, total = self._exchange(call_digest(seed, self._calls), carried, world_size, buffer)
        if agreed:
            if error is not None:
                raise error  # every rank made the same invalid call: each raises its own
            if total is None:
                return perform()
            compute = folded_result(call, reduce, total, out, world_size)
            if compute is None:
                return perform()  # the backend's result could differ from the sum's
            # The folded op's result is the one ``perform`` would have returned.
            return cast(_T, self._through(layers, call, compute))
        site, via = find_call_site()
        description = describe_call(call, self._inner.rank, site, via, self._calls, error)
        # The base class's object op runs on this wrapper's primitives, unseen by inner
        # wrappers.
        descriptions = Collective.all_gather_object(self, description)
        mismatch = CollectiveMismatchError(
            mismatch_message(descriptions, self.compare_call_sites), descriptions
        )
        raise leave_trace(self, call, mismatch, site) from error

    def _run_point_to_point(self, call: OpCall, perform: Callable[[], _T]) -> _T:
        peer = call.root
        # An invalid peer cannot take part in a handshake: fail here, as the op would.
        self._check_ready(call.op, call.tensor)
        self._check_rank("dst" if call.op == "send" else "src", peer)
        rank = self._inner.rank
        if self._inner.world_size == 1 or peer == rank:
            return perform()
        count = self._peer_calls.get(peer, 0) + 1
        self._peer_calls[peer] = count
        site, via = find_call_site()
        values = self._fingerprint(call, site, count)[0]
        mine = torch.tensor(values, dtype=torch.int64, device=self._object_device())
        theirs = torch.empty_like(mine)
        sending = call.op == "send"
        # The sender speaks first and the receiver answers, so the handshake cannot deadlock.
        if sending:
            self._send(mine, peer)
            self._recv_(theirs, peer)
        else:
            self._recv_(theirs, peer)
            self._send(mine, peer)
        width = STRICT_FIELDS if self.compare_call_sites else DEFAULT_FIELDS
        other = [int(v) for v in theirs.tolist()]
        if other[:width] == values[:width]:
            return perform()
        description = describe_call(call, self._inner.rank, site, via, count, None)
        peer_description = self._exchange_with_peer(description, peer, send_first=sending)
        pair = sorted([description, peer_description], key=lambda d: int(d["rank"]))
        mismatch = CollectiveMismatchError(mismatch_message(pair, self.compare_call_sites), pair)
        raise leave_trace(self, call, mismatch, site)

    # ------------------------------------------------------------- fingerprints
    def _fingerprint(
        self, call: OpCall, site: CallSite | None, count: int
    ) -> tuple[list[int], Exception | None, ReduceOp | None]:
        """The `fingerprint` of ``call``, the error the call itself will raise, if any, and
        its reduce op, parsed."""
        values, reduce = fingerprint(call, self._inner.rank, site, count)
        try:
            if call.op in TENSOR_OPS or call.is_point_to_point:
                self._check_ready(call.op, call.tensor)
            if call.reduce_op is not None:
                parsed_op(call.reduce_op)
            if call.root is not None:
                self._check_rank("dst" if call.op in ("gather", "send") else "src", call.root)
        except (TypeError, ValueError) as err:
            return values, err, reduce
        return values, None, reduce

    def _seed(
        self, call: OpCall, site: CallSite | None, world_size: int
    ) -> tuple[int, Exception | None, ReduceOp | None, int | None]:
        """What ``call`` contributes to the check whatever its count: the `_digest` of its
        compared fields, the error the call will raise, if any, its reduce op (parsed) and
        its `fold_limit`. Remembered per kind of valid call outside strict mode, so a call
        like an earlier one costs a lookup."""
        key = call_kind(call) if site is None else None
        if key is not None:
            try:
                known = self._seeds.get(key)
            except TypeError:  # an argument that cannot be hashed
                key = known = None
            if known is not None:
                return known[0], None, known[1], known[2]
        values, error, reduce = self._fingerprint(call, site, 0)
        seed = fields_digest(values, self.compare_call_sites)
        if error is not None:
            return seed, error, reduce, None
        limit = fold_limit(call, reduce, world_size)
        if key is not None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            self._seeds[key] = (seed, reduce, limit)
        return seed, None, reduce, limit

    def _object_device(self) -> torch.device:
        device = self._device
        if device is None:
            device = self._device = self.object_device
        return device

    def _exchange(
        self, mixed: int, carried: float | None, world_size: int, buffer: CheckBuffer
    ) -> tuple[bool, float | None]:
        """Sum every rank's check buffer (`accord.core.wrappers.debug_fold`) for a call of
        64-bit digest ``mixed``. Returns whether every rank's digest equals this one and, when every
        rank folded its call, the sum of the payloads."""
        digest = mixed >> buffer.shift
        check = 2 * digest + (carried is not None)
        first = 0.0 if carried is None else carried
        device = self._object_device()
        # The primitive, not the public op: wrappers inside this one do not see the check.
        if device.type == "cpu":
            numbers = buffer.numbers
            numbers[0] = first
            numbers[1] = check
            self._all_reduce_(buffer.tensor, ReduceOp.SUM)
            total, check_sum = numbers
        else:
            # Where float64 may not be exact (XLA devices), the payload stays home.
            exact = device.type == "cuda"
            sent = torch.tensor(
                [first if exact else 0, check if exact else 2 * digest],
                dtype=torch.float64 if exact else torch.int64,
                device=device,
            )
            self._all_reduce_(sent, ReduceOp.SUM)
            total, check_sum = sent.tolist()
        folded = spread(check_sum, digest, world_size)
        if not 0 <= folded <= world_size:
            return False, None
        return True, (total if folded == world_size else None)

    def _find_place(self) -> tuple[int, int, tuple[CollectiveWrapper, ...], CheckBuffer]:
        """This rank, the world size, the wrappers inside this one (outermost first) and a
        new check buffer for this world size."""
        layers: list[CollectiveWrapper] = []
        layer = self._inner
        while isinstance(layer, CollectiveWrapper):
            layers.append(layer)
            layer = layer.inner
        world_size = self._inner.world_size
        self._place = (self._inner.rank, world_size, tuple(layers), CheckBuffer(world_size))
        return self._place

    @staticmethod
    def _through(
        layers: tuple[CollectiveWrapper, ...], call: OpCall, compute: Callable[[], _T]
    ) -> _T:
        """Run ``compute`` as the operation of the wrappers ``layers`` (outermost first)."""
        run = compute
        for wrapper in reversed(layers):
            run = functools.partial(wrapper._run, call, run)
        return run()

    def _exchange_with_peer(
        self, obj: dict[str, Any], peer: int, *, send_first: bool
    ) -> dict[str, Any]:
        """Swap a picklable ``obj`` with rank ``peer`` over send/recv."""
        device = self._object_device()
        payload = pickle.dumps(obj)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)

        def send() -> None:
            self._send(size, peer)
            self._send(data, peer)

        def receive() -> dict[str, Any]:
            length = torch.empty(1, dtype=torch.int64, device=device)
            self._recv_(length, peer)
            buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
            self._recv_(buffer, peer)
            received: dict[str, Any] = pickle.loads(bytes(buffer.cpu().untyped_storage()))
            return received

        if send_first:
            send()
            return receive()
        received = receive()
        send()
        return received
