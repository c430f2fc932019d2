"""Processes the tests start: scripts in a fresh interpreter, and the test ranks' preload."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["RANK_PRELOAD", "ROOT", "run_python"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root; scripts run from here."""

RANK_PRELOAD = ("pytest", "tests.helpers.models")
"""What the suite's fork server imports for the test ranks, besides torch and accord."""


def run_python(
    args: list[str], timeout: float = 180, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``python args...`` in a fresh process; fail the test with its output if it fails.

    The child gets this process's environment without the variables of a job this process
    may itself be a rank of, plus ``env``; it runs from `ROOT`.
    """
    child_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    child_env.update(env or {})
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        cwd=ROOT,
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"python {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result
