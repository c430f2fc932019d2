"""`DeepSpeedCollective` keeps the collective contract on deepspeed.comm (real gloo processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

pytest.importorskip(
    "deepspeed", reason="DeepSpeedCollective needs deepspeed: pip install 'accord[deepspeed]'"
)

from accord.engines.deepspeed.collective import DeepSpeedCollective
from accord.errors import ConfigurationError
from accord.testing import assert_conformance, run_distributed


@pytest.mark.timeout(600)  # the first run compiles DeepSpeed's shared-memory extension
def test_deepspeed_collective_conforms_at_1_2_3_ranks() -> None:
    assert_conformance(DeepSpeedCollective, world_sizes=(1, 2, 3))


def _joins_torch_group(rank: int, world_size: int) -> tuple[bool, str, float, bool, float]:
    dist.init_process_group("gloo")
    c = DeepSpeedCollective().setup()
    total = c.all_reduce(torch.ones(1)).item()
    backend = c.backend
    c.teardown()
    still_up = dist.is_initialized()
    after = torch.ones(1)
    if still_up:
        dist.all_reduce(after)
        dist.destroy_process_group()
    return c.created_group, backend, total, still_up, after.item()


def test_setup_joins_a_torch_group_and_teardown_leaves_it_up() -> None:
    for created, backend, total, still_up, after in run_distributed(
        _joins_torch_group, 2, timeout=180
    ):
        assert (created, backend, total, still_up, after) == (False, "gloo", 2.0, True, 2.0)


def _creates_destroys_and_recreates(rank: int, world_size: int) -> list[object]:
    c = DeepSpeedCollective().setup()
    first = [c.created_group, c.backend, c.all_reduce(torch.ones(1)).item()]
    c.teardown()
    gone = not dist.is_initialized()
    c.teardown()  # idempotent
    c.setup()
    again = [c.created_group, c.all_reduce(torch.ones(1)).item()]
    c.teardown()
    return [*first, gone, *again, dist.is_initialized()]


def test_teardown_destroys_the_group_it_created_and_setup_works_again() -> None:
    for result in run_distributed(_creates_destroys_and_recreates, 2, timeout=180):
        assert result == [True, "gloo", 2.0, True, True, 2.0, False]


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="Unknown DeepSpeed communication backend"):
        DeepSpeedCollective("glooo")


def _child(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter and return the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_importing_accord_does_not_import_deepspeed() -> None:
    result = _child(
        """
        import json, sys
        import accord, accord.collectives, accord.engines.deepspeed.collective
        from accord.engines.deepspeed.collective import DeepSpeedCollective
        DeepSpeedCollective()
        print(json.dumps({"imported": "deepspeed" in sys.modules}))
        """
    )
    assert result == {"imported": False}


def test_missing_deepspeed_says_how_to_install() -> None:
    result = _child(
        """
        import json, sys

        from accord.engines.deepspeed.collective import DeepSpeedCollective
        from accord.errors import MissingDependencyError

        made_before = DeepSpeedCollective()
        sys.modules["deepspeed"] = None  # hide the installed package
        messages = {}
        try:
            made_before.setup()
        except MissingDependencyError as err:
            messages["setup"] = str(err)
        try:
            DeepSpeedCollective()
        except MissingDependencyError as err:
            messages["init"] = str(err)
        print(json.dumps(messages))
        """
    )
    assert set(result) == {"setup", "init"}
    for message in result.values():
        assert isinstance(message, str)
        assert "DeepSpeedCollective" in message and "`deepspeed`" in message
        assert "pip install 'accord[deepspeed]'" in message


def test_multi_rank_setup_without_a_port_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigurationError, match="MASTER_PORT"):
        DeepSpeedCollective("gloo").setup(rank=0, world_size=2)
