"""Helpers for the SLURM lane's tests: run commands, submit jobs, wait for them."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time

import pytest

from tests.helpers.processes import ROOT

SCRIPTS = ROOT / "tests" / "slurm" / "scripts"

# Variables of the job pytest may itself run in, which would leak into the jobs it submits.
_LEAKING = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
_LEAKING_ALSO = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@functools.cache
def slurm_problem() -> str | None:
    """Why SLURM cannot run accord's jobs here, or None when a cluster answers."""
    for tool in ("srun", "sbatch", "salloc", "sinfo", "squeue", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test-slurm installs SLURM and starts a cluster)"
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 5 s: no SLURM controller is reachable"
    if result.returncode != 0:
        return f"no SLURM cluster answers (sinfo: {result.stderr.strip()[:200]})"
    states = result.stdout.split()
    if not any(state.rstrip("*~#!%$@^-") in ("idle", "mixed", "allocated") for state in states):
        return f"no SLURM node is up (sinfo states: {states or 'none'})"
    return None


def lane_marks() -> list[pytest.MarkDecorator]:
    """A cluster test's marks: ``slurm``, and a skip saying why where no cluster answers.

    Test modules set ``pytestmark = lane_marks()``.
    """
    problem = slurm_problem()
    return [
        pytest.mark.slurm,
        pytest.mark.skipif(problem is not None, reason=f"SLURM cannot run here: {problem}"),
    ]


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variables of a job it may itself be part of."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LEAKING + _LEAKING_ALSO and not key.startswith(("SLURM_", "SBATCH_"))
    }
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env.update(extra)
    return env


def run(
    args: list[str], timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a SLURM command (or anything) from the repository root; never raises on failure."""
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else job_env(),
        cwd=ROOT,
        check=False,
    )


def output(result: subprocess.CompletedProcess[str]) -> str:
    """A finished command's exit status and output, for a failure message."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def sbatch(args: list[str], env: dict[str, str] | None = None) -> int:
    """Submit a batch job (``sbatch --parsable args``); its job id."""
    result = run(["sbatch", "--parsable", *args], timeout=60, env=env)
    assert result.returncode == 0, output(result)
    return int(result.stdout.strip().split(";")[0])


def job_state(job_id: int | str) -> dict[str, str]:
    """``scontrol show job`` as key/value pairs; empty once SLURM forgot the job."""
    result = run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
    if result.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for token in result.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


# Reasons a pending job gives when the cluster cannot ever run it.
_NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "BadConstraints", "ReqNodeNotAvail")


def wait_for_job(job_id: int | str, timeout: float = 300) -> dict[str, str]:
    """Wait until the job has ended for good (not pending, running or requeued); its state."""
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = job_state(job_id)
        state = fields.get("JobState", "")
        if state and state not in (
            "PENDING",
            "RUNNING",
            "CONFIGURING",
            "COMPLETING",
            "REQUEUED",
            "REQUEUE_FED",
            "REQUEUE_HOLD",
            "RESIZING",
            "SUSPENDED",
            "SIGNALING",
            "STAGE_OUT",
        ):
            return fields
        if state == "PENDING" and fields.get("Reason") in _NEVER_STARTS:
            run(["scancel", str(job_id)], timeout=30)
            pytest.fail(f"job {job_id} can never start on this cluster: {fields}")
        time.sleep(1)
    run(["scancel", str(job_id)], timeout=30)
    pytest.fail(f"job {job_id} did not end within {timeout} s (last state: {fields})")
