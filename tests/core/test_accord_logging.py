"""accord's messages go through `logging` under "accord": visible by default, silenced or
redirected the way a user does it for any library, and said once per job where they
should be."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter without any logging configured."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
        check=True,
    )


def test_messages_are_on_stderr_until_logging_is_configured() -> None:
    result = _child(
        """
        import logging
        import accord
        logging.getLogger("accord.trainer.recovery").info("resuming, by default")
        logging.getLogger("accord.core").debug("below the default level")
        """
    )
    assert result.stderr == "[accord] resuming, by default\n"
    assert result.stdout == ""


def test_set_level_silences_them() -> None:
    result = _child(
        """
        import logging
        import accord
        logging.getLogger("accord").setLevel(logging.ERROR)
        logging.getLogger("accord.launchers").warning("silenced")
        logging.getLogger("accord.launchers").error("still said")
        """
    )
    assert result.stderr == "[accord] still said\n"


def test_a_level_set_before_import_is_kept() -> None:
    result = _child(
        """
        import logging
        logging.getLogger("accord").setLevel(logging.WARNING)
        import accord
        logging.getLogger("accord.x").info("not said")
        """
    )
    assert result.stderr == ""


def test_a_handler_of_the_users_redirects_them() -> None:
    result = _child(
        """
        import io, logging
        import accord
        caught = io.StringIO()
        handler = logging.StreamHandler(caught)
        handler.setFormatter(logging.Formatter("%(name)s|%(levelname)s|%(message)s"))
        logging.getLogger("accord").addHandler(handler)
        logging.getLogger("accord.environments.slurm").warning("not requeued")
        print(caught.getvalue(), end="")
        """
    )
    assert result.stdout == "accord.environments.slurm|WARNING|not requeued\n"
    assert result.stderr == ""


def test_a_configured_root_logger_gets_them_once() -> None:
    result = _child(
        """
        import logging
        import accord
        logging.basicConfig(format="root:%(name)s:%(message)s")
        logging.getLogger("accord.trainer").info("once")
        """
    )
    assert result.stderr == "root:accord.trainer:once\n"


@pytest.mark.parametrize(("rank", "said"), [("0", True), ("1", False)])
def test_rank_zero_helpers_speak_on_rank_zero_only(rank: str, said: bool) -> None:
    result = _child(
        """
        import logging
        from accord.log import rank_zero_info, rank_zero_warning
        log = logging.getLogger("accord.example")
        rank_zero_info(log, "step %d done", 3)
        rank_zero_warning(log, "careful")
        """,
        RANK=rank,
    )
    assert result.stderr == ("[accord] step 3 done\n[accord] careful\n" if said else "")


def test_rank_zero_helpers_follow_the_rank_a_strategy_sets() -> None:
    result = _child(
        """
        import logging
        from lightning_utilities.core.rank_zero import rank_zero_only
        from accord.log import rank_zero_info
        rank_zero_only.rank = 1  # what Strategy.setup_environment does on rank 1
        rank_zero_info(logging.getLogger("accord.example"), "not on rank 1")
        """,
        RANK="0",
    )
    assert result.stderr == ""


def test_the_records_name_the_module_that_logged(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from accord.log import rank_zero_info

    caplog.set_level(logging.INFO, logger="accord")
    rank_zero_info(logging.getLogger("accord.example"), "from here")
    (record,) = [r for r in caplog.records if r.name == "accord.example"]
    assert record.getMessage() == "from here"
    assert record.filename == Path(__file__).name
    assert record.funcName == "test_the_records_name_the_module_that_logged"
