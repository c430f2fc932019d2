"""With ``ACCORD_COLLECTIVE_TIMEOUT`` no op waits the backend's 30 minutes: ranks that all
arrived at an op but disagree on its shape fail with a `CollectiveTimeoutError` naming it."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from accord.collectives import TorchCollective
from accord.core.process_group import ProcessGroupCollective
from accord.core.timeouts import TIMEOUT_ENV_VAR, BackendTimeouts, timeout_from_env
from accord.core.wrappers.policy import wrap_collective
from accord.core.wrappers.wrapper import unwrap
from accord.errors import CollectiveError, CollectiveTimeoutError, ConfigurationError
from accord.testing import run_distributed

if TYPE_CHECKING:
    from accord.engines.deepspeed.collective import DeepSpeedCollective


def _base_collective(engine: str) -> TorchCollective | DeepSpeedCollective:
    if engine == "deepspeed":
        from accord.engines.deepspeed.collective import DeepSpeedCollective

        return DeepSpeedCollective(timeout=1800)
    return TorchCollective("gloo", timeout=1800)


def _disagree(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    collective = wrap_collective(_base_collective(engine)).setup()
    started = time.monotonic()
    base = unwrap(collective)
    assert isinstance(base, ProcessGroupCollective)
    # The group's own op timeout followed the variable, not the 1800 s asked for.
    outcome: dict[str, Any] = {"timeout": base.timeout.total_seconds()}
    try:
        # Rank 0 sends 3 values, rank 1 expects 4: gloo waits for the fourth forever.
        collective.all_reduce(torch.ones(3 if rank == 0 else 4), "sum")
        collective.barrier()
    except CollectiveError as err:
        outcome.update(
            kind=type(err).__name__,
            op=getattr(err, "op", None),
            message=str(err),
            seconds=time.monotonic() - started,
        )
    else:
        outcome.update(kind=None, seconds=time.monotonic() - started)
    return outcome


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_shape_mismatch_ends_with_a_named_error(tmp_path: Path, engine: str) -> None:
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    env = {TIMEOUT_ENV_VAR: "5", "ACCORD_TRACE_DIR": str(tmp_path)}
    # Without the variable the op would wait the 1800 s asked for: the test's limit is a hang.
    results = run_distributed(_disagree, 2, engine, timeout=200, env=env)
    for rank, result in enumerate(results):
        assert result["timeout"] == 5.0
        assert result["kind"] == "CollectiveTimeoutError", (rank, result)
    # Rank 1 waited inside the op for data rank 0 never sent: the backend's timeout, named.
    assert results[1]["op"] == "all_reduce"
    assert (
        "all_reduce did not complete within the process group's timeout of 5 s"
        in (results[1]["message"])
    )
    # Rank 0 went on to the barrier; rank 1 never came: the watchdog names rank 1's call.
    assert results[0]["op"] == "barrier"
    assert "all_reduce" in results[0]["message"]


def test_the_variable_replaces_the_collectives_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "7.5")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    collective = TorchCollective("gloo", timeout=1800).setup()
    try:
        assert collective.timeout == timedelta(seconds=7.5)
    finally:
        collective.teardown()


@pytest.mark.parametrize(("raw", "expected"), [("", None), ("0", None), ("-3", None), ("12", 12.0)])
def test_timeout_from_env(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: float | None
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV_VAR, raw)
    value = timeout_from_env()
    assert (None if value is None else value.total_seconds()) == expected


def test_a_timeout_that_is_not_a_number_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "five")
    with pytest.raises(ConfigurationError, match=r"ACCORD_COLLECTIVE_TIMEOUT='five' is not a"):
        TorchCollective("gloo").setup(rank=0, world_size=1)


def test_other_backend_errors_pass_through_unchanged() -> None:
    with (
        pytest.raises(RuntimeError, match="Connection closed by peer") as info,
        BackendTimeouts("barrier", 0, timedelta(seconds=5)),
    ):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert not isinstance(info.value, CollectiveTimeoutError)


def _group_timeout(rank: int, world_size: int, engine: str) -> float:
    import torch.distributed as dist

    collective = _base_collective(engine)
    collective.setup()
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    finally:
        collective.teardown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_the_created_groups_backend_times_out_after_the_variable(engine: str) -> None:
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'accord[deepspeed]'")
    (seconds,) = run_distributed(_group_timeout, 1, engine, timeout=240, env={TIMEOUT_ENV_VAR: "6"})
    assert seconds == 6.0
