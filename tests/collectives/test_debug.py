"""DebugCollective: conforms, and turns mismatched calls into an error on every rank."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from accord.collectives import Collective, SingleDeviceCollective, TorchCollective
from accord.core.wrappers.debug import DebugCollective
from accord.core.wrappers.policy import DEBUG_ENV_VAR, maybe_debug
from accord.core.wrappers.stats import InstrumentedCollective
from accord.core.wrappers.wrapper import unwrap
from accord.errors import CollectiveMismatchError, CollectiveNotSetupError, ConfigurationError
from accord.testing import assert_conformance, run_distributed

# Backend timeout for the mismatch runs: if detection failed, gloo errors out instead of hanging.
_GLOO_TIMEOUT = 20.0
_RUN_TIMEOUT = 120.0


def debug_gloo() -> Collective:
    """The conformance factory (module level, so it pickles into the rank processes)."""
    return DebugCollective(TorchCollective("gloo"))


def test_debug_collective_conforms_at_1_and_2_ranks() -> None:
    assert_conformance(debug_gloo, world_sizes=(1, 2), timeout=_RUN_TIMEOUT)


# ------------------------------------------------------------------ scenarios
Scenario = Callable[[Collective, int], None]


def _shape(c: Collective, rank: int) -> None:
    if rank == 0:
        c.all_reduce(torch.ones(2))
    else:
        c.all_reduce(torch.ones(3))


def _shape_of_calls_seen_before(c: Collective, rank: int) -> None:
    # Both kinds of call have been checked already on both ranks (the check remembers what
    # a kind of call contributes), then the ranks call one each.
    c.all_reduce(torch.ones(2))
    c.all_reduce(torch.ones(3))
    c.all_reduce(torch.ones(2) if rank == 0 else torch.ones(3))


def _dtype(c: Collective, rank: int) -> None:
    if rank == 0:
        c.all_reduce(torch.ones(2, dtype=torch.float32))
    else:
        c.all_reduce(torch.ones(2, dtype=torch.int64))


def _op(c: Collective, rank: int) -> None:
    if rank == 0:
        c.all_reduce(torch.ones(2))
    else:
        c.broadcast(torch.ones(2), src=0)


def _reduce_op(c: Collective, rank: int) -> None:
    c.all_reduce(torch.ones(2), "sum" if rank == 0 else "max")


def _src(c: Collective, rank: int) -> None:
    c.broadcast(torch.ones(2), src=rank)


def _objects(c: Collective, rank: int) -> None:
    if rank == 0:
        c.broadcast_object({"a": 1}, src=0)
    else:
        c.all_gather_object({"a": 1})


def _barrier_vs_gather(c: Collective, rank: int) -> None:
    if rank == 0:
        c.barrier("sync")
    else:
        c.all_gather(torch.ones(4))


def _point_to_point(c: Collective, rank: int) -> None:
    if rank == 0:
        c.send(torch.ones(2), dst=1)
    else:
        c.recv(torch.empty(3), src=0)


def _invalid_op_on_one_rank(c: Collective, rank: int) -> None:
    c.all_reduce(torch.ones(2), "median" if rank == 0 else "sum")


def _same_call_from_two_lines(c: Collective, rank: int) -> None:
    # Correct code: the same broadcast from two branches must not be flagged by default.
    if rank == 0:
        result = c.broadcast(torch.full((2,), 7.0), src=0)
    else:
        result = c.broadcast(torch.zeros(2), src=0)
    assert result.tolist() == [7.0, 7.0]


def _sync_and_async(c: Collective, rank: int) -> None:
    # Correct code: rank 0 starts the same small all_reduce asynchronously, which is not
    # folded there, so every rank sends it the backend's way and both get the sum.
    x = torch.tensor([float(rank + 1)])
    started = c.all_reduce(x, "sum", async_op=True) if rank == 0 else None
    result = c.all_reduce(x, "sum") if started is None else started.wait()
    assert result.tolist() == [3.0]


# Whether this tree's collectives take ``async_op`` yet.
_ASYNC = "async_op" in inspect.signature(Collective.all_reduce).parameters

_SCENARIOS: dict[str, Scenario] = {
    "shape": _shape,
    "shape_of_calls_seen_before": _shape_of_calls_seen_before,
    "dtype": _dtype,
    "op": _op,
    "reduce_op": _reduce_op,
    "src": _src,
    "objects": _objects,
    "barrier_vs_gather": _barrier_vs_gather,
    "point_to_point": _point_to_point,
    "invalid_op_on_one_rank": _invalid_op_on_one_rank,
    "same_call_from_two_lines": _same_call_from_two_lines,
}
if _ASYNC:
    _SCENARIOS["sync_and_async"] = _sync_and_async


def _run_scenarios(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Run every scenario on one group; after each, check the group still works."""
    collective = DebugCollective(TorchCollective("gloo", timeout=_GLOO_TIMEOUT)).setup()
    # A second checker on the same group that also compares call sites.
    strict = DebugCollective(TorchCollective("gloo"), compare_call_sites=True).setup()
    results: dict[str, dict[str, Any]] = {}
    runs: list[tuple[str, Collective, Scenario]] = [
        (name, collective, fn) for name, fn in _SCENARIOS.items()
    ]
    runs.append(("strict_call_sites", strict, _same_call_from_two_lines))
    try:
        for name, c, scenario in runs:
            outcome: dict[str, Any] = {"type": None, "message": "", "calls": [], "cause": None}
            site = ""
            try:
                scenario(c, rank)
            except CollectiveMismatchError as err:
                outcome.update(
                    type=type(err).__name__,
                    message=str(err),
                    calls=err.calls,
                    cause=type(err.__cause__).__name__ if err.__cause__ else None,
                )
                # Ground truth for the call site: the scenario's line that raised.
                tb = err.__traceback__
                if tb is not None and tb.tb_next is not None:
                    site = f"{__file__}:{tb.tb_next.tb_lineno}"
            outcome["site"] = site
            outcome["after"] = c.all_reduce(torch.ones(1)).item()
            results[name] = outcome
    finally:
        strict.teardown()
        collective.teardown()
    return results


@pytest.fixture(scope="module")
def scenarios() -> list[dict[str, dict[str, Any]]]:
    """Every scenario's outcome, per rank (one 2-rank run for the whole module)."""
    return run_distributed(_run_scenarios, 2, timeout=_RUN_TIMEOUT)


def _mismatch_on_both(results: list[dict[str, dict[str, Any]]], name: str) -> list[str]:
    messages = []
    for rank, per_rank in enumerate(results):
        outcome = per_rank[name]
        assert outcome["type"] == "CollectiveMismatchError", (name, rank, outcome)
        assert outcome["after"] == 2.0, f"{name}: the group is unusable after the error"
        messages.append(outcome["message"])
    # Both ranks name both call sites.
    sites = [per_rank[name]["site"] for per_rank in results]
    assert all(sites), sites
    for message in messages:
        for site in sites:
            assert site in message, (site, message)
    return messages


def test_shape_mismatch_raises_on_both_ranks_naming_shapes_and_sites(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    for message in _mismatch_on_both(scenarios, "shape"):
        assert "differ in shape" in message
        assert "all_reduce(shape=(2,)" in message
        assert "all_reduce(shape=(3,)" in message
        assert "rank 0:" in message
        assert "rank 1:" in message
    calls = scenarios[0]["shape"]["calls"]
    assert [c["shape"] for c in calls] == [[2], [3]]
    assert [c["op"] for c in calls] == ["all_reduce", "all_reduce"]


def test_a_mismatch_between_kinds_of_call_seen_before_is_caught(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    for message in _mismatch_on_both(scenarios, "shape_of_calls_seen_before"):
        assert "differ in shape" in message
        assert "[call #" in message


def test_dtype_mismatch(scenarios: list[dict[str, dict[str, Any]]]) -> None:
    for message in _mismatch_on_both(scenarios, "dtype"):
        assert "differ in dtype" in message
        assert "torch.float32" in message
        assert "torch.int64" in message


def test_op_mismatch(scenarios: list[dict[str, dict[str, Any]]]) -> None:
    for message in _mismatch_on_both(scenarios, "op"):
        assert "differ in op" in message
        assert "rank 0: all_reduce(" in message
        assert "rank 1: broadcast(" in message


def test_reduce_op_and_src_mismatches(scenarios: list[dict[str, dict[str, Any]]]) -> None:
    for message in _mismatch_on_both(scenarios, "reduce_op"):
        assert "op=sum" in message
        assert "op=max" in message
    for message in _mismatch_on_both(scenarios, "src"):
        assert "src=0" in message
        assert "src=1" in message


def test_object_and_barrier_mismatches(scenarios: list[dict[str, dict[str, Any]]]) -> None:
    for message in _mismatch_on_both(scenarios, "objects"):
        assert "rank 0: broadcast_object(src=0)" in message
        assert "rank 1: all_gather_object()" in message
    for message in _mismatch_on_both(scenarios, "barrier_vs_gather"):
        assert "rank 0: barrier(name='sync')" in message
        assert "rank 1: all_gather(shape=(4,)" in message


def test_send_recv_mismatch_is_caught_by_the_pair(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    for message in _mismatch_on_both(scenarios, "point_to_point"):
        assert "rank 0: send(shape=(2,)" in message
        assert "rank 1: recv(shape=(3,)" in message


def test_invalid_op_on_one_rank_fails_everywhere(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    messages = _mismatch_on_both(scenarios, "invalid_op_on_one_rank")
    assert "op='median'" in messages[1]
    assert "invalid there: ValueError" in messages[1]
    assert scenarios[0]["invalid_op_on_one_rank"]["cause"] == "ValueError"
    assert scenarios[1]["invalid_op_on_one_rank"]["cause"] is None


def test_same_call_from_two_lines_passes_unless_strict(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    for per_rank in scenarios:
        assert per_rank["same_call_from_two_lines"]["type"] is None
    for message in _mismatch_on_both(scenarios, "strict_call_sites"):
        assert "differ in call site" in message


@pytest.mark.skipif(not _ASYNC, reason="Collective.all_reduce takes no async_op here")
def test_a_call_folded_on_one_rank_only_runs_the_backends_way_everywhere(
    scenarios: list[dict[str, dict[str, Any]]],
) -> None:
    for rank, per_rank in enumerate(scenarios):
        outcome = per_rank["sync_and_async"]
        assert outcome["type"] is None, (rank, outcome)
        assert outcome["after"] == 2.0


# ------------------------------------------------------------- in one process
def test_maybe_debug_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = SingleDeviceCollective()
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)
    assert maybe_debug(plain) is plain
    monkeypatch.setenv(DEBUG_ENV_VAR, "0")
    assert maybe_debug(plain) is plain
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    wrapped = maybe_debug(plain)
    assert isinstance(wrapped, DebugCollective)
    assert wrapped.inner is plain
    assert not wrapped.compare_call_sites
    assert maybe_debug(wrapped) is wrapped
    stacked = InstrumentedCollective(wrapped)
    assert maybe_debug(stacked) is stacked  # already checked further in
    monkeypatch.setenv(DEBUG_ENV_VAR, "strict")
    strict = maybe_debug(plain)
    assert isinstance(strict, DebugCollective)
    assert strict.compare_call_sites
    monkeypatch.setenv(DEBUG_ENV_VAR, "loud")
    with pytest.raises(ConfigurationError, match=DEBUG_ENV_VAR):
        maybe_debug(plain)


def test_wrapper_forwards_identity_and_pickles() -> None:
    inner = SingleDeviceCollective()
    c = DebugCollective(inner)
    assert not c.is_setup
    with pytest.raises(CollectiveNotSetupError):
        c.all_reduce(torch.ones(1))
    assert pickle.loads(pickle.dumps(c)).inner.backend_name == inner.backend_name
    c.setup()
    assert (c.rank, c.world_size, c.is_setup) == (0, 1, True)
    assert c.backend_name == inner.backend_name
    assert c.object_device == torch.device("cpu")
    assert unwrap(InstrumentedCollective(c)) is inner
    assert c.all_reduce(torch.ones(2), "mean").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="Unsupported reduce op"):
        c.all_reduce(torch.ones(1), "median")
    assert c.calls_checked == 2
    c.teardown()
    assert not c.is_setup and not inner.is_setup


class _PretendTwoRanks(SingleDeviceCollective):
    """A world of 'two' whose other rank sends what this one sends: enough to drive the
    check in-process."""

    @property
    def world_size(self) -> int:
        return 2

    def _all_reduce_(self, buffer: torch.Tensor, op: Any) -> None:
        buffer.mul_(2)


def test_a_copy_does_not_share_the_check_buffer() -> None:
    c = DebugCollective(_PretendTwoRanks()).setup()
    # The check agreed and the sum was folded into it: this rank's one, twice.
    assert c.all_reduce(torch.tensor(1.0)).item() == 2.0
    copied = pickle.loads(pickle.dumps(c))
    assert copied.__dict__["_place"] is None  # with the check buffer
    assert copied.all_reduce(torch.tensor(3.0)).item() == 6.0
    assert c.all_reduce(torch.tensor(1.0)).item() == 2.0


# ------------------------------------------------- one round trip for small calls
class _CountingGloo(TorchCollective):
    """gloo, counting the primitives each call reaches (the real backend underneath)."""

    def __init__(self) -> None:
        super().__init__("gloo", timeout=_GLOO_TIMEOUT)
        self.sent: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.sent[name] = self.sent.get(name, 0) + 1

    def _all_reduce_(self, buffer: torch.Tensor, op: Any) -> None:
        self._count("all_reduce")
        super()._all_reduce_(buffer, op)

    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._count("all_gather")
        super()._all_gather_into(output, tensor)

    def _broadcast_(self, buffer: torch.Tensor, src: int) -> None:
        self._count("broadcast")
        super()._broadcast_(buffer, src)


_REDUCE_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
)
_OPS = ("sum", "mean", "max", "min", "product")


def _inputs(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Per-rank values that overflow small integer types and round in low precision."""
    g = torch.Generator().manual_seed(1000 * rank + len(shape) + _REDUCE_DTYPES.index(dtype))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 300).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**40)), min(info.max, 2**40)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(result: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = result.detach().contiguous().reshape(-1)
    return str(result.dtype), tuple(result.shape), bytes(flat.view(torch.uint8).tolist())


def _outcome(fn: Callable[[], torch.Tensor]) -> Any:
    try:
        return _bits(fn())
    except (TypeError, ValueError, RuntimeError) as err:
        return type(err).__name__


def _fold_against_backend(rank: int, world_size: int) -> dict[str, Any]:
    """Every op, dtype and form through plain gloo and through the debug check: the bits."""
    plain = TorchCollective("gloo", timeout=_GLOO_TIMEOUT).setup()
    counting = _CountingGloo()
    checked = DebugCollective(counting).setup()
    mismatches: list[str] = []
    touched: list[str] = []

    def compare(label: str, run: Callable[[Collective], torch.Tensor]) -> None:
        expected, got = _outcome(lambda: run(plain)), _outcome(lambda: run(checked))
        if expected != got:
            mismatches.append(f"{label}: backend {expected!r}, debug {got!r}")

    try:
        for dtype in _REDUCE_DTYPES:
            for shape in ((), (1,), (1, 1), (3,), (0,)):  # one element folds
                x = _inputs(rank, dtype, shape)
                before = _bits(x)
                for op in _OPS:
                    label = f"{op} {dtype} {shape}"
                    compare(label, lambda c, x=x, op=op: c.all_reduce(x, op))
                    compare(
                        f"{label} out=",
                        lambda c, x=x, op=op: c.all_reduce(
                            x, op, out=torch.empty_like(plain.all_reduce(x, op))
                        ),
                    )
                    compare(
                        f"{label} in place",
                        lambda c, x=x, op=op: c.all_reduce(y := x.clone(), op, out=y),
                    )
                if _bits(x) != before:
                    touched.append(f"{dtype} {shape}")
                compare(f"all_gather {dtype} {shape}", lambda c, x=x: c.all_gather(x))
                compare(f"broadcast {dtype} {shape}", lambda c, x=x: c.broadcast(x, src=1))
                compare(
                    f"broadcast out= {dtype} {shape}",
                    lambda c, x=x: c.broadcast(x, src=1, out=torch.empty_like(x)),
                )
        # Where the backend's order decides: NaN, and zeros of both signs under max/min.
        special = torch.tensor(
            [float("nan"), 1.0, 0.0, -0.0] if rank == 0 else [1.0, float("nan"), -0.0, 0.0]
        )
        for op in _OPS:
            compare(f"{op} of NaN and signed zeros", lambda c, op=op: c.all_reduce(special, op))
        # One-element sums the float64 wire must not settle: a NaN, an infinity minus
        # itself, a float32 overflow, integers that wrap or do not fit in 53 bits, and
        # zeros of both signs.
        edges = {
            "NaN": torch.tensor(float("nan") if rank == 0 else 1.0),
            "inf - inf": torch.tensor(float("inf") if rank == 0 else float("-inf")),
            "float32 overflow": torch.tensor(3e38),
            "-0.0 + -0.0": torch.tensor(-0.0),
            "-0.0 + 0.0": torch.tensor(-0.0 if rank == 0 else 0.0),
            "int8 wraps": torch.tensor([100], dtype=torch.int8),
            "uint8 wraps": torch.tensor(200, dtype=torch.uint8),
            "int64 beyond 2**53": torch.tensor(2**60 + rank, dtype=torch.int64),
            "float64 NaN payload": torch.tensor(float("nan"), dtype=torch.float64),
        }
        for label, edge in edges.items():
            for op in ("sum", "mean"):
                compare(f"{op} of {label}", lambda c, e=edge, op=op: c.all_reduce(e, op))
            compare(f"broadcast of {label}", lambda c, e=edge: c.broadcast(e, src=0))
        # Transposed (not contiguous) input, and a wrong out= on every rank.
        t = _inputs(rank, torch.float32, (2, 2)).t()
        compare("sum of a transposed input", lambda c: c.all_reduce(t, "sum"))
        compare("out= of the wrong dtype", lambda c: c.all_reduce(t, out=torch.empty(2, 2).long()))
        # What travels for a one-element sum or broadcast: the check's all_reduce only.
        counting.sent.clear()
        checked.all_reduce(torch.tensor(float(rank)), "sum")
        checked.all_reduce(torch.tensor([rank], dtype=torch.int32), "sum")
        checked.broadcast(torch.tensor([rank], dtype=torch.float16), src=0)
        scalar_traffic = dict(counting.sent)
        # Anything else: the check, then the backend's op.
        counting.sent.clear()
        checked.all_reduce(torch.ones(2), "sum")
        checked.all_reduce(torch.tensor(1.0), "max")
        large_traffic = dict(counting.sent)
    finally:
        checked.teardown()
        plain.teardown()
    return {
        "mismatches": mismatches,
        "touched": touched,
        "scalar": scalar_traffic,
        "large": large_traffic,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_folded_calls_give_the_backends_bits_in_one_round_trip(world_size: int) -> None:
    for rank, result in enumerate(run_distributed(_fold_against_backend, world_size)):
        assert result["mismatches"] == [], (rank, result["mismatches"])
        assert result["touched"] == [], rank
        # Three one-element calls: one collective each, the check and the payload together ...
        calls = 3
        if world_size > 2:
            # ... except a floating-point sum beyond two ranks: the check, then the backend.
            calls += 1
        assert result["scalar"] == {"all_reduce": calls}, result["scalar"]
        # Two elements, and a max: the check, then the backend's all_reduce, for each.
        assert result["large"] == {"all_reduce": 4}, result["large"]
