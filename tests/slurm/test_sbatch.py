"""The SLURM example a user copies (examples/slurm/train.sbatch), submitted with ``sbatch``:
preemption through ``--signal``-style SIGUSR1, requeue by rank zero, resume by itself."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.slurm import (
    ROOT,
    job_env,
    job_state,
    lane_marks,
    output,
    run,
    sbatch,
    wait_for_job,
)

pytestmark = lane_marks()

EXAMPLE = ROOT / "examples" / "slurm"
SBATCH_SCRIPT = EXAMPLE / "train.sbatch"
DOCS = ROOT / "docs" / "multi-node.md"
# 4096 samples, batch 32, two ranks: 64 optimizer steps per epoch.
EPOCHS = 20
STEPS = 64 * EPOCHS


def _submit(root: Path) -> int:
    root.mkdir()
    env = job_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return sbatch(
        [
            f"--chdir={EXAMPLE}",
            f"--output={root}/job.out",
            str(SBATCH_SCRIPT),
            "--root",
            str(root),
            "--epochs",
            str(EPOCHS),
        ],
        env=env,
    )


def _log(root: Path) -> str:
    path = root / "job.out"
    return path.read_text() if path.exists() else "(no job.out)"


def test_the_docs_sbatch_script_is_the_tested_example() -> None:
    text = DOCS.read_text()
    blocks = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, flags=re.S)
    assert SBATCH_SCRIPT.read_text() in blocks, (
        "docs/multi-node.md must show examples/slurm/train.sbatch verbatim"
    )


@pytest.mark.timeout(600)
def test_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    full_job = _submit(full)
    job = _submit(preempted)

    # Once the first periodic checkpoint exists the job is training: warn every task.
    checkpoints = preempted / "checkpoints"
    deadline = time.monotonic() + 240
    while not list(checkpoints.glob("*.ckpt")):
        state = job_state(job).get("JobState", "")
        if time.monotonic() > deadline or state not in ("PENDING", "RUNNING", "CONFIGURING"):
            run(["scancel", str(job), str(full_job)], timeout=60)
            pytest.fail(f"no checkpoint yet and the job is {state!r}:\n{_log(preempted)}")
        time.sleep(0.2)
    signalled = run(["scancel", "--signal=USR1", str(job)], timeout=60)
    assert signalled.returncode == 0, output(signalled)

    state = wait_for_job(job, timeout=420)
    log = _log(preempted)
    assert state["JobState"] == "COMPLETED", f"{state}\n{log}"
    assert state["Restarts"] == "1", f"{state}\n{log}"
    # scancel signals every task; the ranks stop together at the first step boundary after
    # the first of them saw it (the others may see it a moment later), once.
    stopped = re.findall(r"SIGUSR1 reached ranks? ([\d, ]+): every rank stopped at step (\d+)", log)
    assert len(stopped) == 1, log
    assert set(stopped[0][0].split(", ")) <= {"0", "1"}, log
    step = int(stopped[0][1])
    assert 0 < step < STEPS, log
    assert "SLURMEnvironment: the job was requeued" in log, log
    assert "job " in log and "restart 1," in log, log
    checkpoint = checkpoints / "preempted.ckpt"
    assert re.search(rf"restart 1: resuming from '{re.escape(str(checkpoint))}'", log), log
    assert f"trained {STEPS} steps" in log, log

    full_state = wait_for_job(full_job, timeout=300)
    assert full_state["JobState"] == "COMPLETED", f"{full_state}\n{_log(full)}"
    assert full_state["Restarts"] == "0"
    resumed = torch.load(preempted / "model.pt", weights_only=True)
    uninterrupted = torch.load(full / "model.pt", weights_only=True)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


def test_requeue_outside_a_batch_job_says_why_and_returns_false() -> None:
    code = "from accord.environments import SLURMEnvironment as E; print('->', E().requeue())"
    result = run(["srun", "-N1", "-n1", sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, output(result)
    assert "-> False" in result.stdout, output(result)
    assert "the job was not requeued: scontrol requeue" in result.stderr, output(result)
    assert "sbatch --requeue" in result.stderr
