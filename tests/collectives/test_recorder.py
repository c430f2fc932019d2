"""RecordingCollective: a bounded record of every call, and the merged timeline of a fit."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import Callback
from accord.collectives import SingleDeviceCollective
from accord.core.wrappers.policy import maybe_record, wrap_collective
from accord.core.wrappers.recorder import RecordingCollective, find_recorder
from accord.core.wrappers.trace_files import (
    CAPACITY_ENV_VAR,
    TRACE_DIR_ENV_VAR,
    dump_path,
    merge_timeline,
)
from accord.errors import CollectiveError, ConfigurationError
from accord.strategies import DDPStrategy
from accord.testing import run_distributed
from accord.trace import first_divergence, load, summarize
from accord.trace.__main__ import main as trace_main
from accord.trace.records import RankCalls
from tests.helpers.models import LinearModel, loader

THIS_FILE = str(Path(__file__).resolve())


def _recorded(capacity: int | None = None) -> RecordingCollective:
    return RecordingCollective(SingleDeviceCollective(), capacity).setup()


def test_records_op_shape_dtype_bytes_times_site_and_step() -> None:
    collective = _recorded()
    steps = iter([7, 8])
    collective.step_source = lambda: next(steps)
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    collective.all_reduce(torch.ones(2, 3, dtype=torch.float64), "max")
    collective.barrier("sync")
    first, second = collective.records
    assert (first.seq, first.op, first.shape, first.dtype) == (1, "all_reduce", (2, 3), "float64")
    assert (first.nbytes, first.arg, first.step, first.state) == (48, "max", 7, "ok")
    assert first.site.filename == THIS_FILE and first.site.lineno == line
    assert first.end is not None and first.end >= first.start
    assert (second.seq, second.op, second.label, second.shape, second.nbytes) == (
        2,
        "barrier",
        "sync",
        None,
        0,
    )
    assert second.start >= first.end


def test_ring_buffer_keeps_the_last_calls_and_counts_the_dropped() -> None:
    collective = _recorded(capacity=3)
    for _ in range(5):
        collective.all_reduce(torch.ones(1))
    assert [r.seq for r in collective.records] == [3, 4, 5]
    assert collective.dropped == 2
    collective.capacity = 2
    assert [r.seq for r in collective.records] == [4, 5]
    collective.reset()
    collective.broadcast(torch.ones(1))
    assert [r.seq for r in collective.records] == [6]  # numbers go on: ranks must agree


def test_a_failing_call_is_recorded_as_failed() -> None:
    collective = _recorded()
    with pytest.raises(ValueError, match="op"):
        collective.all_reduce(torch.ones(1), "nonsense")
    (record,) = collective.records
    assert (record.op, record.state) == ("all_reduce", "failed")


def test_bad_capacities_say_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="positive number of calls"):
        RecordingCollective(SingleDeviceCollective(), 0)
    monkeypatch.setenv(CAPACITY_ENV_VAR, "many")
    with pytest.raises(ConfigurationError, match=f"{CAPACITY_ENV_VAR}='many'"):
        RecordingCollective(SingleDeviceCollective())
    monkeypatch.setenv(CAPACITY_ENV_VAR, "7")
    assert RecordingCollective(SingleDeviceCollective()).capacity == 7


def test_dump_writes_a_readable_file_atomically(tmp_path: Path) -> None:
    collective = _recorded()
    collective.all_gather(torch.zeros(4, dtype=torch.int32))
    path = collective.dump(directory=tmp_path)
    assert path == dump_path(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["collectives-rank0.json"]
    (rank,) = load(tmp_path)
    (call,) = rank.calls
    assert (call["op"], call["shape"], call["dtype"], call["bytes"]) == (
        "all_gather",
        [4],
        "int32",
        16,
    )
    assert call["site"].startswith(f"{THIS_FILE}:")


def test_the_step_source_does_not_travel_with_a_pickle() -> None:
    collective = _recorded()
    collective.step_source = lambda: 1
    collective.all_reduce(torch.ones(1))
    copy = pickle.loads(pickle.dumps(collective))
    assert copy.step_source is None and len(copy.records) == 1


def test_recording_is_off_unless_a_check_or_a_trace_dir_asks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("ACCORD_DEBUG_COLLECTIVES", "ACCORD_COLLECTIVE_TIMEOUT", TRACE_DIR_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    plain = SingleDeviceCollective()
    assert wrap_collective(plain) is plain  # off: no layer, nothing to pay
    assert find_recorder(wrap_collective(plain, debug=True)) is not None
    monkeypatch.setenv(TRACE_DIR_ENV_VAR, str(tmp_path))
    recorded = maybe_record(plain)
    assert isinstance(recorded, RecordingCollective)
    assert maybe_record(recorded) is recorded


def test_merge_timeline_writes_chrome_trace(tmp_path: Path) -> None:
    collective = _recorded()
    collective.all_reduce(torch.ones(3))
    collective.barrier()
    gathered = collective.gather_records()
    assert gathered is not None
    path = merge_timeline(gathered, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["all_reduce", "barrier"]
    assert all(e["pid"] == 0 and e["tid"] == 0 and e["dur"] >= 0 for e in slices)
    assert slices[0]["ts"] == 0 and slices[1]["ts"] >= slices[0]["dur"]


def test_trace_command_says_what_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert trace_main([str(tmp_path)]) == 2
    assert "holds no collectives-rank<N>.json dump" in capsys.readouterr().err
    (tmp_path / "collectives-rank0.json").write_text("{}")
    assert trace_main([str(tmp_path)]) == 2
    assert "neither an accord dump" in capsys.readouterr().err


# ------------------------------------------------------------------ a 2-rank fit
class Talks(Callback):
    """Calls the strategy's collectives from this file at the end of each epoch."""

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        trainer.strategy.barrier("epoch")
        trainer.strategy.all_gather(torch.ones(2) * trainer.global_rank)


_BARRIER_LINE = inspect.getsourcelines(Talks.on_train_epoch_end)[1] + 1


def _timeline_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    trainer = accord.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[Talks()],
        profiler="timeline",
    )
    trainer.fit(LinearModel(), loader(16))
    recorder = find_recorder(trainer.strategy.collective)
    assert recorder is not None
    return {"calls": [(r.seq, r.op) for r in recorder.records], "steps": trainer.global_step}


@pytest.mark.timeout(240)
def test_a_ddp_fit_writes_one_chrome_trace_with_every_call_of_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_timeline_fit, 2, str(tmp_path), timeout=200)
    files = sorted(tmp_path.rglob("*.json"))
    assert [f.name for f in files] == ["collective-timeline-fit.json"]
    trace = json.loads(files[0].read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= set(event)
        if event["ph"] == "X":
            assert isinstance(event["ts"], float) and event["dur"] >= 0
            assert event["pid"] == event["tid"] == event["args"]["rank"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank, result in enumerate(results):
        slices = [e["args"] for e in events if e["ph"] == "X" and e["pid"] == rank]
        # Every call the rank made is in the trace, in order.
        assert [(s["seq"], s["op"]) for s in slices] == result["calls"]
        ops = {s["op"] for s in slices}
        assert {"all_gather", "barrier"} <= ops
        barriers = [s for s in slices if s["op"] == "barrier" and s["label"] == "epoch"]
        assert len(barriers) == 2
        assert all(
            s["site"] == f"{THIS_FILE}:{_BARRIER_LINE} in on_train_epoch_end" for s in barriers
        )
        # The Trainer's own calls point at the user's line that started the fit.
        assert all(s["site"].startswith(f"{THIS_FILE}:") for s in slices)
        assert max(s["step"] for s in slices) == result["steps"]
    # The same calls on both ranks: nothing differs, and the summary totals them.
    ranks = load(tmp_path)
    assert first_divergence(ranks) is None
    summary = summarize(ranks)
    assert summary.ops[0]["barrier"].calls == summary.ops[1]["barrier"].calls >= 2
    assert set(trace["otherData"]["clock_offsets_s"]) == {"0", "1"}


def test_a_single_device_fit_writes_a_timeline(tmp_path: Path) -> None:
    trainer = accord.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[Talks()],
        profiler="timeline",
    )
    trainer.fit(LinearModel(), loader(16))
    trace = json.loads((tmp_path / "collective-timeline-fit.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0}
    assert "barrier epoch" in {e["name"] for e in slices}


class LosesItsPeers(Callback):
    """Fails the way a dead peer makes a rank fail, after one collective call."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        trainer.strategy.barrier("before")
        raise CollectiveError("Connection closed by peer")


def test_a_communication_failure_in_a_fit_leaves_the_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRACE_DIR_ENV_VAR, str(tmp_path / "traces"))
    trainer = accord.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[LosesItsPeers()],
    )
    with pytest.raises(CollectiveError) as caught:
        trainer.fit(LinearModel(), loader(16))
    path = tmp_path / "traces" / "collectives-rank0.json"
    assert f"last 1 collective calls are in {path}" in str(caught.value)
    (rank,) = load(path)
    assert [(c["op"], c["label"], c["step"]) for c in rank.calls] == [("barrier", "before", 1)]
    assert rank.error == "CollectiveError: Connection closed by peer"


def _debug_timeline_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    strategy = DDPStrategy(debug=True)
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        profiler="timeline",
    )
    trainer.fit(LinearModel(), loader(16))
    recorder = find_recorder(strategy.collective)
    assert recorder is not None
    return {
        "outermost": type(strategy.collective).__name__,
        "recorder_inside": recorder is not strategy.collective,
        "capacity": recorder.capacity,
        "calls": len(recorder.records),
    }


@pytest.mark.timeout(240)
def test_the_timeline_reuses_the_recorder_debug_mode_brings(tmp_path: Path) -> None:
    results = run_distributed(_debug_timeline_fit, 2, str(tmp_path), timeout=200)
    for result in results:
        # The debug check stays outermost; its recorder, closest to the backend, is enlarged.
        assert result["outermost"] == "DebugCollective" and result["recorder_inside"]
        assert result["capacity"] >= 100_000 and result["calls"] > 0
    trace = json.loads((tmp_path / "collective-timeline-fit.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert len(slices) == sum(result["calls"] for result in results)


def test_the_summary_counts_no_waiting_where_the_ranks_made_different_calls() -> None:
    """At a sequence number where rank 0 sat in a barrier and rank 1 in an all_reduce
    (a desync), neither was waiting for the other; the calls both made still count."""

    def call(seq: int, op: str, start: float, end: float) -> dict[str, Any]:
        return {"seq": seq, "op": op, "start": start, "end": end, "bytes": 4}

    ranks = [
        RankCalls(0, 2, [call(1, "all_gather", 0.0, 0.5), call(2, "barrier", 1.0, 9.0)]),
        RankCalls(1, 2, [call(1, "all_gather", 0.4, 0.5), call(2, "all_reduce", 1.0, 1.1)]),
    ]
    summary = summarize(ranks)
    assert summary.ops[0]["all_gather"].waiting == pytest.approx(0.4)
    assert summary.ops[0]["barrier"].waiting == 0.0
    assert summary.ops[1]["all_reduce"].waiting == 0.0
    assert summary.straggler == 1
