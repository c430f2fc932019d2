"""``all_reduce(..., async_op=True)``: handles, old collectives, wrappers, errors, and DDP's hook.

Everything runs in real processes over gloo.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accord
from accord.collectives import (
    Collective,
    InstrumentedCollective,
    ReduceOp,
    ReduceOpLike,
    TorchCollective,
)
from accord.core.handle import CollectiveHandle
from accord.core.wrappers.recorder import RecordingCollective
from accord.errors import CollectiveTimeoutError
from accord.strategies import DDPStrategy
from accord.testing import run_conformance, run_distributed
from tests.helpers.models import LinearModel, flat_weights, loader


class AsyncForgetsTheMean(TorchCollective):
    """Its asynchronous mean is a sum: the synchronous form is right, the handle is not."""

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> Any:
        if async_op and str(op).lower() == "mean":
            return super().all_reduce(tensor, "sum", out=out, async_op=True)
        return super().all_reduce(tensor, op, out=out, async_op=async_op)


class AsyncCompletesEarly(TorchCollective):
    """Its asynchronous primitive says done before anything was reduced."""

    def _all_reduce_async_(self, buffer: torch.Tensor, op: ReduceOp) -> Any:
        return None


def test_the_suite_catches_a_broken_async_all_reduce() -> None:
    checks = ["all_reduce.mean", "all_reduce.async"]
    for broken in (AsyncForgetsTheMean, AsyncCompletesEarly):
        report = run_conformance(broken, world_sizes=(2,), checks=checks)
        assert report.failed_checks == ["all_reduce.async"], (broken, report.violations)


class SyncOnlyOverride(TorchCollective):
    """Written before async_op existed: all_reduce has no such parameter."""

    def all_reduce(  # type: ignore[override]
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.seen = getattr(self, "seen", 0) + 1
        return super().all_reduce(tensor, op, out=out)


class OwnPrimitive(TorchCollective):
    """Overrides the synchronous primitive only: async calls must still go through it."""

    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.primitive_calls = getattr(self, "primitive_calls", 0) + 1
        super()._all_reduce_(buffer, op)


class Counting:
    """A mixin a user writes: counts, then passes the call on; it knows no async_op."""

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.seen = getattr(self, "seen", 0) + 1
        return super().all_reduce(tensor, op, out=out)  # type: ignore[misc, no-any-return]


class CountingTorch(Counting, TorchCollective):  # type: ignore[misc]
    """The mixin's all_reduce, inherited rather than defined here."""


class OwnPrimitiveMixin:
    """A mixin with the synchronous primitive only."""

    def _all_reduce_(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.primitive_calls = getattr(self, "primitive_calls", 0) + 1
        super()._all_reduce_(buffer, op)  # type: ignore[misc]


class OwnPrimitiveTorch(OwnPrimitiveMixin, TorchCollective):
    """The mixin's primitive before TorchCollective's own asynchronous one."""


def test_old_style_collectives_pass_the_async_check() -> None:
    for factory in (SyncOnlyOverride, OwnPrimitive, CountingTorch, OwnPrimitiveTorch):
        report = run_conformance(factory, world_sizes=(1, 2), checks=["all_reduce.async"])
        assert report.passed, (factory, report.violations)


def _old_style(
    rank: int, world_size: int, sync_only_kind: type[Collective], own_kind: type[Collective]
) -> dict[str, Any]:
    sync_only = sync_only_kind().setup()
    handle = InstrumentedCollective(sync_only).all_reduce(
        torch.tensor([1.0 + rank]), "mean", async_op=True
    )
    own = own_kind().setup()
    second = own.all_reduce(torch.tensor([2.0 * rank]), "sum", async_op=True)
    result = {
        "adapted": (type(handle).__name__, handle.is_completed(), handle.wait().tolist()),
        "seen": getattr(sync_only, "seen", 0),
        "primitive": (second.wait().tolist(), getattr(own, "primitive_calls", 0)),
    }
    own.teardown()
    sync_only.teardown()
    return result


@pytest.mark.parametrize(
    ("sync_only_kind", "own_kind"),
    [(SyncOnlyOverride, OwnPrimitive), (CountingTorch, OwnPrimitiveTorch)],
    ids=["defined_on_the_class", "inherited_from_a_mixin"],
)
def test_old_style_overrides_run_under_async_op(
    sync_only_kind: type[Collective], own_kind: type[Collective]
) -> None:
    for result in run_distributed(_old_style, 2, sync_only_kind, own_kind, timeout=120):
        assert result["adapted"] == ("CollectiveHandle", True, [1.5])
        assert result["seen"] == 1
        assert result["primitive"] == ([2.0], 1)


def test_a_completed_handle_and_its_future() -> None:
    value = torch.ones(2)
    handle = CollectiveHandle.completed(value)
    assert handle.is_completed()
    assert handle.wait() is value
    assert handle.get_future().wait() is value
    seen: list[BaseException | None] = []
    handle.add_done_callback(seen.append)
    assert seen == [None]
    assert repr(handle) == "CollectiveHandle(completed)"


def _recorded(rank: int, world_size: int) -> dict[str, Any]:
    stats_layer = InstrumentedCollective(TorchCollective("gloo"))
    collective = RecordingCollective(stats_layer).setup()
    handles = [
        collective.all_reduce(torch.full((64,), float(rank)), async_op=True) for _ in range(3)
    ]
    # A handle's done callbacks run before wait() returns: the records and counts are final.
    values = [handle.wait()[0].item() for handle in handles]
    records = [r for r in collective.records if r.op == "all_reduce"]
    result = {
        "values": values,
        "states": [r.state for r in records],
        "ended": all(r.end is not None and r.end >= r.start for r in records),
        "calls": stats_layer.stats["all_reduce"].calls,
        "bytes": stats_layer.stats["all_reduce"].bytes,
    }
    collective.teardown()
    return result


def test_wrappers_record_async_calls_when_they_complete() -> None:
    for result in run_distributed(_recorded, 2, timeout=120):
        assert result["values"] == [1.0, 1.0, 1.0]
        assert result["states"] == ["ok", "ok", "ok"]
        assert result["ended"]
        assert result["calls"] == 3
        assert result["bytes"] == 3 * 64 * 4


def _mismatched(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    recorder = RecordingCollective(TorchCollective("gloo", timeout=3), directory=directory)
    collective = recorder.setup()
    # Rank 0 sends 3 values, rank 1 expects 4: gloo waits for the missing one until its
    # timeout. Rank 0 stays up until rank 1 has its error, so rank 1 times out rather than
    # losing its peer.
    store = dist.distributed_c10d._get_default_store()
    handle = collective.all_reduce(torch.ones(3 if rank == 0 else 4), "sum", async_op=True)
    error = _raises(handle.wait)
    if rank == 1:
        store.set("rank 1 has its error", "1")
    else:
        store.wait(["rank 1 has its error"], timedelta(seconds=60))
    outcome: dict[str, Any] = {
        "kind": type(error).__name__,
        "op": getattr(error, "op", None),
        "state": collective.records[-1].state,
        "again": type(_raises(handle.wait)).__name__,
        "message": str(error),
    }
    return outcome


def _raises(call: Any) -> BaseException | None:
    try:
        call()
    except BaseException as err:
        return err
    return None


@pytest.mark.timeout(120)
def test_a_backend_timeout_in_an_async_op_is_a_named_error(tmp_path: Path) -> None:
    result = run_distributed(_mismatched, 2, str(tmp_path), timeout=90)[1]
    # Rank 1 waited inside the op for data rank 0 never sent: the backend's timeout, named.
    assert result["kind"] == CollectiveTimeoutError.__name__, result
    assert result["op"] == "all_reduce"
    assert result["state"] == "timeout"
    assert result["again"] == CollectiveTimeoutError.__name__
    # The recorder closed the call when it failed and wrote rank 1's calls for the error.
    assert f"{tmp_path}" in result["message"], result["message"]
    assert list(tmp_path.iterdir()), "no trace file was written"


class CountsAsyncStarts(TorchCollective):
    """Keeps the size of every asynchronous all-reduce it starts."""

    def _all_reduce_async_(self, buffer: torch.Tensor, op: ReduceOp) -> Any:
        self.async_sizes = [*getattr(self, "async_sizes", []), buffer.numel()]
        return super()._all_reduce_async_(buffer, op)


def _ddp_fit(rank: int, world_size: int, gradient_sync: str) -> dict[str, Any]:
    collective: Collective = CountsAsyncStarts("gloo")
    strategy = DDPStrategy(collective=collective, gradient_sync=gradient_sync)  # type: ignore[arg-type]
    model = LinearModel()
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    weights = flat_weights(model)
    # A gradient bucket holds every parameter of this small model (and the slots of the
    # step decision it carries); other asynchronous all-reduces are smaller.
    sizes = getattr(collective, "async_sizes", [])
    return {
        "starts": sum(size >= weights.numel() for size in sizes),
        "steps": trainer.global_step,
        "weights": weights,
    }


def test_ddp_collective_gradient_sync_reduces_buckets_asynchronously() -> None:
    native = run_distributed(_ddp_fit, 2, "native", timeout=120)
    hooked = run_distributed(_ddp_fit, 2, "collective", timeout=120)
    for result in hooked:
        # Every bucket (one per step here) went through the asynchronous form.
        assert result["starts"] >= result["steps"] > 0
        torch.testing.assert_close(result["weights"], hooked[0]["weights"], rtol=0, atol=0)
    assert all(result["starts"] == 0 for result in native)
    torch.testing.assert_close(hooked[0]["weights"], native[0]["weights"], rtol=1e-5, atol=1e-6)
