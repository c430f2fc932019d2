"""The collective conformance suite: every line of the `Collective` contract, checked in
real processes.

Point it at any `Collective` factory (a class, or a picklable callable returning a
collective that has not been set up)::

    from accord.testing import assert_conformance
    assert_conformance(MyCollective, world_sizes=(1, 2, 3))

Each world size runs in fresh processes started by `run_distributed`, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and the suite calls
``collective.setup()`` with no arguments. Expected values are computed from the
collective's own ``rank`` and ``world_size``, so a collective that is local to each
process (world size 1) is checked as such. Every violated contract line is reported by
name (``"all_reduce.mean"``, ``"inputs_unchanged"``, ...), per rank and world size.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from accord.core.collective import Collective, ReduceOp
from accord.testing.multiprocess import run_distributed

__all__ = [
    "CHECKS",
    "ConformanceError",
    "ConformanceReport",
    "Violation",
    "assert_conformance",
    "run_checks_in_this_process",
    "run_conformance",
]

CollectiveFactory = Callable[[], Collective]


@dataclass(frozen=True)
class Violation:
    """One contract line a collective broke, on one rank of one world size."""

    check: str
    world_size: int
    rank: int
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] world_size={self.world_size} rank={self.rank}: {self.message}"


@dataclass
class ConformanceReport:
    """What `run_conformance` found: the checks it ran and the violations, if any."""

    world_sizes: tuple[int, ...]
    checks: tuple[str, ...]
    violations: list[Violation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no contract line was violated."""
        return not self.violations

    @property
    def failed_checks(self) -> list[str]:
        """Names of the violated contract lines, each once, in suite order."""
        seen = {v.check for v in self.violations}
        return [name for name in self.checks if name in seen]

    def raise_for_violations(self) -> None:
        """Raise `ConformanceError` listing every violation, if there is any."""
        if self.violations:
            raise ConformanceError(self)


class ConformanceError(AssertionError):
    """A collective broke its contract; the message names each violated line."""

    def __init__(self, report: ConformanceReport) -> None:
        self.report = report
        lines = "\n".join(f"  {v}" for v in report.violations)
        super().__init__(
            f"{len(report.violations)} violation(s) of the collective contract in "
            f"{report.failed_checks}:\n{lines}"
        )


class _ViolationError(AssertionError):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise _ViolationError(message)


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    _expect(
        actual.dtype == expected.dtype,
        f"{what}: dtype {actual.dtype}, expected {expected.dtype}",
    )
    _expect(
        tuple(actual.shape) == tuple(expected.shape),
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}",
    )
    ok = (
        torch.equal(actual.cpu(), expected.cpu())
        if not expected.is_floating_point()
        else torch.allclose(actual.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)
    )
    _expect(ok, f"{what}: got {actual.tolist()}, expected {expected.tolist()}")


def _rank_tensor(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-rank 2x3 tensor whose values depend on the rank (and on the element)."""
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return (base + 1 + rank * 10).to(dtype)


def _stack(world_size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([_rank_tensor(r, dtype) for r in range(world_size)])


def _expected_reduce(stack: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    if stack.dtype == torch.bool:
        if op is ReduceOp.SUM:
            return stack.to(torch.int64).sum(0)
        if op is ReduceOp.MEAN:
            return stack.to(torch.get_default_dtype()).mean(0)
        if op in (ReduceOp.MAX,):
            return stack.any(0)
        return stack.all(0)
    if op is ReduceOp.MEAN:
        work = stack if stack.is_floating_point() else stack.to(torch.get_default_dtype())
        return work.sum(0) / stack.shape[0]
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.MAX:
        return stack.max(0).values
    if op is ReduceOp.MIN:
        return stack.min(0).values
    return stack.prod(0)


# ----------------------------------------------------------------------------- checks
# Each check does all its communication before asserting, so one rank's failed
# assertion does not leave the others waiting in a collective it skipped.

_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool)


def _check_identity(c: Collective, launched_rank: int, launched_size: int) -> None:
    _expect(c.is_setup, "is_setup is False after setup()")
    if c.world_size == 1:
        _expect(c.rank == 0, f"rank is {c.rank} in a world of size 1")
        return
    _expect(
        (c.rank, c.world_size) == (launched_rank, launched_size),
        f"rank/world_size are {(c.rank, c.world_size)}, the launcher set "
        f"{(launched_rank, launched_size)} (RANK/WORLD_SIZE)",
    )


def _check_all_reduce(c: Collective, op: ReduceOp) -> None:
    for dtype in _DTYPES:
        tensor = _rank_tensor(c.rank, dtype)
        result = c.all_reduce(tensor, op.value)
        _same(result, _expected_reduce(_stack(c.world_size, dtype), op), f"{op.value} of {dtype}")


def _check_op_names(c: Collective) -> None:
    tensor = _rank_tensor(c.rank, torch.float32)
    spelled = {
        "SUM": ReduceOp.SUM,
        "Mean": ReduceOp.MEAN,
        "avg": ReduceOp.MEAN,
        "MAX": ReduceOp.MAX,
        "min": ReduceOp.MIN,
        "product": ReduceOp.PRODUCT,
    }
    results = {name: c.all_reduce(tensor, name) for name in spelled}
    stack = _stack(c.world_size, torch.float32)
    for name, op in spelled.items():
        _same(results[name], _expected_reduce(stack, op), f"op name {name!r}")
    try:
        c.all_reduce(tensor, "median")
    except ValueError as err:
        _expect(
            "sum" in str(err) and "mean" in str(err),
            f"the ValueError for an unknown op does not name the valid ones: {err}",
        )
    else:
        raise _ViolationError("all_reduce(op='median') did not raise ValueError")


def _check_integer_mean(c: Collective) -> None:
    tensor = torch.tensor([c.rank, 1], dtype=torch.int64)
    result = c.all_reduce(tensor, "mean")
    _expect(result.is_floating_point(), f"mean of int64 returned {result.dtype}")
    expected = torch.tensor([(c.world_size - 1) / 2, 1.0], dtype=result.dtype)
    _same(result, expected, "mean of int64")


def _check_inputs_unchanged(c: Collective) -> None:
    tensors = {name: _rank_tensor(c.rank, torch.float32) for name in ("ar", "bc", "ag", "rs")}
    tensors["rs"] = torch.arange(2 * c.world_size, dtype=torch.float32) + c.rank
    before = {name: t.clone() for name, t in tensors.items()}
    c.all_reduce(tensors["ar"], "sum")
    c.broadcast(tensors["bc"], src=0)
    c.all_gather(tensors["ag"])
    c.reduce_scatter(tensors["rs"], "sum")
    for name, label in (
        ("ar", "all_reduce"),
        ("bc", "broadcast"),
        ("ag", "all_gather"),
        ("rs", "reduce_scatter"),
    ):
        _expect(torch.equal(tensors[name], before[name]), f"{label} modified its input")


def _check_result_device(c: Collective) -> None:
    tensor = _rank_tensor(c.rank, torch.float32)
    results = {
        "all_reduce": c.all_reduce(tensor),
        "broadcast": c.broadcast(tensor),
        "all_gather": c.all_gather(tensor),
        "reduce_scatter": c.reduce_scatter(torch.ones(c.world_size)),
    }
    for name, result in results.items():
        _expect(
            result.device == tensor.device,
            f"{name} returned a tensor on {result.device}, the input was on {tensor.device}",
        )


def _check_out(c: Collective) -> None:
    tensor = _rank_tensor(c.rank, torch.float32)
    out = torch.empty_like(tensor)
    returned = c.all_reduce(tensor, "sum", out=out)
    in_place = tensor.clone()
    returned_in_place = c.all_reduce(in_place, "sum", out=in_place)
    gathered = torch.empty(c.world_size, *tensor.shape)
    returned_gather = c.all_gather(tensor, out=gathered)
    bcast = torch.empty_like(tensor)
    returned_bcast = c.broadcast(tensor, src=0, out=bcast)
    mean_out = torch.empty(2)
    c.all_reduce(torch.tensor([c.rank, 1]), "mean", out=mean_out)
    expected = _expected_reduce(_stack(c.world_size, torch.float32), ReduceOp.SUM)
    _expect(returned is out, "all_reduce(out=) did not return out")
    _same(out, expected, "all_reduce(out=)")
    _expect(returned_in_place is in_place, "all_reduce(t, out=t) did not return t")
    _same(in_place, expected, "all_reduce(t, out=t) (in place)")
    _expect(returned_gather is gathered, "all_gather(out=) did not return out")
    _same(gathered, _stack(c.world_size, torch.float32), "all_gather(out=)")
    _expect(returned_bcast is bcast, "broadcast(out=) did not return out")
    _same(bcast, _rank_tensor(0, torch.float32), "broadcast(out=)")
    _same(mean_out, torch.tensor([(c.world_size - 1) / 2, 1.0]), "all_reduce(int, mean, out=)")


def _check_broadcast(c: Collective) -> None:
    results = {
        (src, dtype): c.broadcast(_rank_tensor(c.rank, dtype), src=src)
        for src in range(c.world_size)
        for dtype in _DTYPES
    }
    for (src, dtype), result in results.items():
        _same(result, _rank_tensor(src, dtype), f"broadcast of {dtype} from src={src}")


def _check_all_gather(c: Collective) -> None:
    results = {dtype: c.all_gather(_rank_tensor(c.rank, dtype)) for dtype in _DTYPES}
    for dtype, result in results.items():
        _same(result, _stack(c.world_size, dtype), f"all_gather of {dtype} (rank order)")


def _check_reduce_scatter(c: Collective) -> None:
    ws = c.world_size
    tensors = {
        op: torch.arange(2 * ws * 3, dtype=torch.float64).reshape(2 * ws, 3) + c.rank
        for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX)
    }
    results = {op: c.reduce_scatter(t, op.value) for op, t in tensors.items()}
    int_result = c.reduce_scatter(torch.arange(ws, dtype=torch.int64) + c.rank, "mean")
    for op, result in results.items():
        stack = torch.stack(
            [
                torch.arange(2 * ws * 3, dtype=torch.float64).reshape(2 * ws, 3) + r
                for r in range(ws)
            ]
        )
        full = _expected_reduce(stack, op)
        _same(result, full[2 * c.rank : 2 * c.rank + 2], f"reduce_scatter {op.value}")
    expected_int = torch.tensor([c.rank + (ws - 1) / 2], dtype=torch.get_default_dtype())
    _same(int_result, expected_int, "reduce_scatter mean of int64")
    if ws > 1:
        try:
            c.reduce_scatter(torch.ones(ws + 1), "sum")
        except ValueError:
            pass
        else:
            raise _ViolationError(
                "reduce_scatter of a first dimension not divisible by world_size did not raise "
                "ValueError"
            )


def _check_shapes(c: Collective) -> None:
    scalar = torch.tensor(float(c.rank + 1))
    empty = torch.empty(0, 3)
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4) + c.rank
    strided = wide.t()  # non-contiguous
    results = {
        "0-d all_reduce": (
            c.all_reduce(scalar),
            torch.tensor(float(sum(range(1, c.world_size + 1)))),
        ),
        "0-d broadcast": (c.broadcast(scalar, src=0), torch.tensor(1.0)),
        "0-d all_gather": (
            c.all_gather(scalar),
            torch.arange(1, c.world_size + 1, dtype=torch.float32),
        ),
        "empty all_reduce": (c.all_reduce(empty), torch.empty(0, 3)),
        "empty broadcast": (c.broadcast(empty), torch.empty(0, 3)),
        "empty all_gather": (c.all_gather(empty), torch.empty(c.world_size, 0, 3)),
        "non-contiguous all_reduce": (
            c.all_reduce(strided),
            sum(
                ((torch.arange(12.0).reshape(3, 4) + r).t() for r in range(c.world_size)),
                torch.zeros(4, 3),
            ),
        ),
        "non-contiguous broadcast": (
            c.broadcast(strided, src=0),
            torch.arange(12.0).reshape(3, 4).t(),
        ),
        "non-contiguous all_gather": (
            c.all_gather(strided),
            torch.stack([(torch.arange(12.0).reshape(3, 4) + r).t() for r in range(c.world_size)]),
        ),
    }
    for name, (actual, expected) in results.items():
        _same(actual, expected, name)
    _expect(
        torch.equal(strided, (torch.arange(12.0).reshape(3, 4) + c.rank).t()),
        "a non-contiguous input was modified",
    )


def _check_barrier(c: Collective) -> None:
    c.barrier()
    c.barrier("conformance")


_NESTED = {"a": [1, 2.5, ("x", None)], "b": {"c": {1, 2}}, "t": "text"}


def _check_objects(c: Collective) -> None:
    mine = {**_NESTED, "rank": c.rank, "tensor": torch.tensor([c.rank])}
    srcs = range(c.world_size)
    broadcast = {src: c.broadcast_object(mine if c.rank == src else None, src=src) for src in srcs}
    gathered = c.all_gather_object(mine)
    empty = c.all_gather_object([] if c.rank % 2 else "")
    for src, obj in broadcast.items():
        _expect(
            isinstance(obj, dict)
            and obj.get("rank") == src
            and obj["a"] == _NESTED["a"]
            and obj["b"] == _NESTED["b"]
            and torch.equal(obj["tensor"], torch.tensor([src])),
            f"broadcast_object from src={src} gave {obj!r}",
        )
    _expect(len(gathered) == c.world_size, f"all_gather_object returned {len(gathered)} items")
    for rank, obj in enumerate(gathered):
        _expect(
            isinstance(obj, dict) and obj.get("rank") == rank and obj["b"] == _NESTED["b"],
            f"all_gather_object item {rank} is {obj!r} (rank order)",
        )
    _expect(
        empty == [[] if r % 2 else "" for r in range(c.world_size)],
        f"all_gather_object of empty objects gave {empty!r}",
    )
    _expect(pickle.loads(pickle.dumps(gathered[0]["a"])) == _NESTED["a"], "objects round-trip")


def _optional(c: Collective, op: str, run: Callable[[], None]) -> None:
    """An optional op either works or raises NotImplementedError naming the backend."""
    try:
        run()
    except NotImplementedError as err:
        _expect(
            c.backend_name in str(err),
            f"{op}: NotImplementedError does not name the backend {c.backend_name!r}: {err}",
        )


def _check_point_to_point(c: Collective) -> None:
    def run() -> None:
        ws, rank = c.world_size, c.rank
        if ws == 1:
            return
        # A ring: even ranks send first, odd ranks receive first, so no rank deadlocks.
        payload = torch.full((3,), float(rank))
        template = torch.empty(3)
        right, left = (rank + 1) % ws, (rank - 1) % ws
        if rank % 2 == 0:
            c.send(payload, dst=right)
            got = c.recv(template, src=left)
        else:
            got = c.recv(template, src=left)
            c.send(payload, dst=right)
        _same(got, torch.full((3,), float(left)), f"recv from {left}")

    _optional(c, "send/recv", run)


def _check_gather_scatter(c: Collective) -> None:
    def run_gather() -> None:
        dst = c.world_size - 1
        result = c.gather(_rank_tensor(c.rank, torch.float32), dst=dst)
        if c.rank == dst:
            _expect(result is not None, "gather returned None on dst")
            assert result is not None
            _same(result, _stack(c.world_size, torch.float32), f"gather to dst={dst}")
        else:
            _expect(result is None, "gather returned a tensor on a rank that is not dst")

    def run_scatter() -> None:
        src = c.world_size - 1
        source = _stack(c.world_size, torch.float32) * (1 if c.rank == src else -1)
        _same(
            c.scatter(source, src=src),
            _rank_tensor(c.rank, torch.float32),
            f"scatter from src={src}",
        )

    _optional(c, "gather", run_gather)
    _optional(c, "scatter", run_scatter)


def _check_all_to_all(c: Collective) -> None:
    def run() -> None:
        ws = c.world_size
        # Chunk j of rank r holds 100 * r + j, so rank r must receive 100 * j + r from rank j.
        source = torch.tensor([100.0 * c.rank + j for j in range(ws)])
        expected = torch.tensor([100.0 * j + c.rank for j in range(ws)])
        _same(c.all_to_all(source), expected, "all_to_all")

    _optional(c, "all_to_all", run)


def _check_repeat_setup(c: Collective, factory: CollectiveFactory) -> None:
    c.setup()  # again: a no-op
    _same(
        c.all_reduce(torch.ones(1)),
        torch.full((1,), float(c.world_size)),
        "all_reduce after a second setup()",
    )
    fresh = factory().setup()
    created = fresh.created_group
    fresh.teardown()
    fresh.teardown()  # idempotent
    _expect(not fresh.is_setup, "is_setup is True after teardown()")
    again = fresh.setup()
    result = again.all_reduce(torch.ones(1))
    again.teardown()
    _same(result, torch.full((1,), float(c.world_size)), "all_reduce after teardown() + setup()")
    _expect(not created, "a second collective created a group while one existed (it must join)")


def _check_join_existing(c: Collective, factory: CollectiveFactory) -> None:
    joiner = factory().setup()
    joined = joiner.all_reduce(torch.ones(1))
    joiner_created = joiner.created_group
    joiner.teardown()
    after = c.all_reduce(torch.ones(1))  # the group must still be up
    _expect(
        c.created_group or c.world_size == 1,
        "the first collective did not record that it created the group",
    )
    _expect(
        not joiner_created, "a collective joining an existing group recorded that it created it"
    )
    _same(joined, torch.full((1,), float(c.world_size)), "all_reduce on a joined group")
    _same(
        after,
        torch.full((1,), float(c.world_size)),
        "all_reduce after the joiner's teardown() (it must not destroy the group)",
    )


#: Every contract line, by name, in the order the suite checks them.
CHECKS: tuple[str, ...] = (
    "setup.identity",
    *(f"all_reduce.{op.value}" for op in ReduceOp),
    "all_reduce.op_names",
    "all_reduce.integer_mean",
    "inputs_unchanged",
    "result_device",
    "out",
    "broadcast.src",
    "all_gather.rank_order",
    "reduce_scatter",
    "shapes",
    "barrier",
    "objects",
    "send_recv",
    "gather_scatter",
    "all_to_all",
    "setup.repeat",
    "setup.join_existing",
)


def _run_one(name: str, c: Collective, factory: CollectiveFactory, rank: int, size: int) -> None:
    if name == "setup.identity":
        _check_identity(c, rank, size)
    elif name.startswith("all_reduce.") and name.split(".", 1)[1] in {o.value for o in ReduceOp}:
        _check_all_reduce(c, ReduceOp(name.split(".", 1)[1]))
    elif name == "setup.repeat":
        _check_repeat_setup(c, factory)
    elif name == "setup.join_existing":
        _check_join_existing(c, factory)
    else:
        _SIMPLE[name](c)


_SIMPLE: dict[str, Callable[[Collective], None]] = {
    "all_reduce.op_names": _check_op_names,
    "all_reduce.integer_mean": _check_integer_mean,
    "inputs_unchanged": _check_inputs_unchanged,
    "result_device": _check_result_device,
    "out": _check_out,
    "broadcast.src": _check_broadcast,
    "all_gather.rank_order": _check_all_gather,
    "reduce_scatter": _check_reduce_scatter,
    "shapes": _check_shapes,
    "barrier": _check_barrier,
    "objects": _check_objects,
    "send_recv": _check_point_to_point,
    "gather_scatter": _check_gather_scatter,
    "all_to_all": _check_all_to_all,
}


def _suite_worker(
    rank: int, world_size: int, factory: CollectiveFactory, checks: Sequence[str]
) -> list[tuple[str, str]]:
    failures: list[tuple[str, str]] = []
    collective = factory()
    try:
        collective.setup()
    except Exception:
        return [("setup.identity", "setup() raised:\n" + traceback.format_exc())]
    try:
        for name in checks:
            try:
                _run_one(name, collective, factory, rank, world_size)
            except _ViolationError as err:
                failures.append((name, str(err)))
            except Exception as err:
                failures.append((name, f"raised {type(err).__name__}: {err}"))
    finally:
        collective.teardown()
    return failures


def run_conformance(
    factory: CollectiveFactory,
    world_sizes: Iterable[int] = (1, 2, 3),
    *,
    checks: Iterable[str] | None = None,
    timeout: float = 180.0,
) -> ConformanceReport:
    """Run the conformance suite on ``factory``'s collectives and report every violation.

    Args:
        factory: a picklable callable (a class, a module-level function or a
            `functools.partial` of one) returning a collective that is not set up.
        world_sizes: the process counts to run the suite at.
        checks: a subset of `CHECKS` (default: all of them).
        timeout: seconds each world size may take before its processes are stopped.

    Raises:
        ValueError: an unknown check name.
        RankFailureError: a rank crashed or hung (a collective that deadlocks).
    """
    selected = _selected(checks)
    sizes = tuple(world_sizes)
    report = ConformanceReport(world_sizes=sizes, checks=selected)
    for size in sizes:
        per_rank = run_distributed(_suite_worker, size, factory, selected, timeout=timeout)
        for rank, failures in enumerate(per_rank):
            report.violations.extend(Violation(n, size, rank, m) for n, m in failures)
    return report


def _selected(checks: Iterable[str] | None) -> tuple[str, ...]:
    selected = tuple(CHECKS if checks is None else checks)
    unknown = [name for name in selected if name not in CHECKS]
    if unknown:
        raise ValueError(f"Unknown conformance checks {unknown}; choose from {list(CHECKS)}.")
    return selected


def run_checks_in_this_process(
    factory: CollectiveFactory,
    checks: Iterable[str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> list[Violation]:
    """Run the suite in this process, as one rank of a job that a launcher started.

    For backends whose processes an outside launcher starts (``horovodrun``, ``mpirun``,
    a cluster's job runner), where `run_conformance` cannot start them itself: every
    process of the job calls this with the same ``checks``, and the suite sets a
    collective from ``factory`` up, runs each check and tears it down, as in
    `run_conformance`.

    Args:
        factory: returns a collective that is not set up (it need not be picklable).
        checks: a subset of `CHECKS` (default: all of them).
        rank, world_size: what the launcher assigned this process, which
            ``setup.identity`` compares the collective's rank and world size with;
            default: ``RANK`` and ``WORLD_SIZE`` from the environment, else 0 and 1.

    Returns:
        This rank's violations (empty when it kept the contract). The suite's
        collective is torn down by then, so report them per rank (print them, or
        write a file per rank) and combine the ranks' lists outside the job.

    Raises:
        ValueError: an unknown check name.
    """
    selected = _selected(checks)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    failures = _suite_worker(rank, world_size, factory, selected)
    return [Violation(name, world_size, rank, message) for name, message in failures]


def assert_conformance(
    factory: CollectiveFactory,
    world_sizes: Iterable[int] = (1, 2, 3),
    *,
    checks: Iterable[str] | None = None,
    timeout: float = 180.0,
) -> None:
    """Run `run_conformance` and raise `ConformanceError` (an AssertionError) on any violation.

    The pytest-friendly form: call it in a test, or parametrize over `CHECKS` and pass
    ``checks=[name]`` for one test per contract line.
    """
    run_conformance(factory, world_sizes, checks=checks, timeout=timeout).raise_for_violations()
