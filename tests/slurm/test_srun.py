"""accord under a real ``srun``: ranks and the rendezvous from SLURM's own variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accord.environments import SLURMEnvironment
from tests.helpers.slurm import (
    ROOT,
    SCRIPTS,
    job_env,
    lane_marks,
    output,
    run,
    sbatch,
    wait_for_job,
)

pytestmark = lane_marks()

FIT = SCRIPTS / "slurm_fit.py"


def _ranks(out: Path, count: int) -> list[dict[str, Any]]:
    files = sorted(out.glob("rank*.pt"))
    assert [f.name for f in files] == [f"rank{r}.pt" for r in range(count)], files
    return [torch.load(f, weights_only=False) for f in files]


def _srun_fit(out: Path, srun_args: list[str], devices: int) -> subprocess.CompletedProcess[str]:
    return run(
        [
            "srun",
            "--kill-on-bad-exit=1",
            *srun_args,
            sys.executable,
            str(FIT),
            str(out),
            str(devices),
        ]
    )


def test_ddp_with_two_tasks_takes_ranks_and_address_from_slurm(tmp_path: Path) -> None:
    result = _srun_fit(tmp_path, ["-N1", "-n2"], devices=2)
    assert result.returncode == 0, output(result)
    ranks = _ranks(tmp_path, 2)
    for rank, info in enumerate(ranks):
        slurm = info["slurm"]
        assert info["environment"] == "SLURMEnvironment"
        assert info["global_rank"] == rank == int(slurm["SLURM_PROCID"])
        assert info["local_rank"] == rank == int(slurm["SLURM_LOCALID"])
        assert info["node_rank"] == 0 == int(slurm["SLURM_NODEID"])
        assert info["world_size"] == 2 == int(slurm["SLURM_NTASKS"])
        assert info["main_address"] == slurm["SLURM_NODELIST"].split(",")[0]
        assert info["global_step"] == 16  # 256 samples, 2 ranks, batch 16, 2 epochs
    assert ranks[0]["main_port"] == ranks[1]["main_port"]
    assert ranks[0]["slurm"]["SLURM_JOB_ID"] == ranks[1]["slurm"]["SLURM_JOB_ID"]
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    assert torch.isfinite(ranks[0]["weights"]).all()


@pytest.mark.parametrize(
    ("srun_args", "devices", "said"),
    [
        (["-N1", "--ntasks-per-node=2"], 1, "--ntasks-per-node=2"),
        (["-N1", "-n2"], 3, "2 tasks per node"),
    ],
)
def test_devices_disagreeing_with_the_tasks_per_node_is_a_clear_error(
    tmp_path: Path, srun_args: list[str], devices: int, said: str
) -> None:
    result = _srun_fit(tmp_path, srun_args, devices=devices)
    assert result.returncode != 0
    assert "ConfigurationError" in result.stderr, output(result)
    message = result.stderr[result.stderr.index("ConfigurationError") :]
    assert f"Trainer(devices={devices}) disagrees" in message
    assert said in message and "one SLURM task per device" in message
    assert not list(tmp_path.glob("rank*.pt"))  # no rank trained


def test_num_nodes_disagreeing_with_the_step_is_a_clear_error(tmp_path: Path) -> None:
    result = run(["srun", "-N1", "-n2", sys.executable, str(FIT), str(tmp_path), "1", "2"])
    assert result.returncode != 0
    assert "Trainer(num_nodes=2) disagrees with the SLURM job step" in result.stderr, output(result)


def test_two_job_steps_at_once_do_not_collide_on_ports(tmp_path: Path) -> None:
    """Two ``srun`` steps of one job train at the same time, each on its own port."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    script = tmp_path / "two_steps.sh"
    # --overlap: both steps share the job's two CPUs instead of waiting for each other.
    step = f"srun --overlap -N1 -n2 {sys.executable} {FIT}"
    meet = tmp_path / "meet"
    meet.mkdir()
    script.write_text(
        "#!/bin/bash\n"
        f"export MEET_DIR={meet} MEET_COUNT=4\n"
        f"{step} {first} 2 &\n"
        f"{step} {second} 2 &\n"
        "wait %1 || exit 1\n"
        "wait %2 || exit 2\n"
    )
    job = sbatch(["-N1", "-n2", f"--output={tmp_path}/job.out", str(script)])
    state = wait_for_job(job)
    log = (tmp_path / "job.out").read_text()
    assert state["JobState"] == "COMPLETED", f"{state}\n{log}"
    one, two = _ranks(first, 2), _ranks(second, 2)
    assert one[0]["slurm"]["SLURM_STEP_ID"] != two[0]["slurm"]["SLURM_STEP_ID"]
    assert one[0]["main_port"] != two[0]["main_port"]
    assert torch.equal(one[0]["weights"], two[1]["weights"])


def test_a_job_array_trains_each_task_on_its_own_port(tmp_path: Path) -> None:
    script = tmp_path / "array.sh"
    meet = tmp_path / "meet"
    meet.mkdir()
    script.write_text(
        "#!/bin/bash\n"
        f"export MEET_DIR={meet} MEET_COUNT=4\n"
        f"mkdir -p {tmp_path}/task$SLURM_ARRAY_TASK_ID\n"
        f"srun {sys.executable} {FIT} {tmp_path}/task$SLURM_ARRAY_TASK_ID 2\n"
    )
    job = sbatch(
        [
            "--array=0-1",
            "-N1",
            "--ntasks-per-node=2",
            "--oversubscribe",
            f"--output={tmp_path}/array_%a.out",
            str(script),
        ]
    )
    for task in (0, 1):
        state = wait_for_job(f"{job}_{task}")
        log = (tmp_path / f"array_{task}.out").read_text()
        assert state["JobState"] == "COMPLETED", f"{state}\n{log}"
    zero, one = _ranks(tmp_path / "task0", 2), _ranks(tmp_path / "task1", 2)
    assert zero[0]["slurm"]["SLURM_JOB_ID"] != one[0]["slurm"]["SLURM_JOB_ID"]
    assert zero[0]["main_port"] != one[0]["main_port"]
    assert torch.equal(zero[0]["weights"], one[0]["weights"])


def test_accord_inside_salloc_trains_through_srun(tmp_path: Path) -> None:
    """``salloc`` gives an allocation; ``srun`` inside it starts the ranks."""
    result = run(
        [
            "salloc",
            "-N1",
            "-n2",
            "srun",
            sys.executable,
            str(FIT),
            str(tmp_path),
            "2",
        ]
    )
    assert result.returncode == 0, output(result)
    ranks = _ranks(tmp_path, 2)
    assert all(info["environment"] == "SLURMEnvironment" for info in ranks)
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])


def test_a_salloc_shell_without_srun_is_a_local_run(tmp_path: Path) -> None:
    """In the allocation's own shell (no step) accord is not SLURM-started: a local run."""
    result = run(
        ["salloc", "-N1", "-n2", sys.executable, str(FIT), str(tmp_path), "2"],
        env=job_env(),
    )
    assert result.returncode == 0, output(result)
    ranks = _ranks(tmp_path, 2)
    assert ranks[0]["environment"] == "LocalEnvironment"
    assert "SLURM_JOB_ID" in ranks[0]["slurm"] and "SLURM_STEP_ID" not in ranks[0]["slurm"]
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])


def test_the_port_is_the_same_on_every_task_of_a_step() -> None:
    code = (
        "from accord.environments import SLURMEnvironment as E; e = E(); "
        "print(E.detect(), e.global_rank(), e.main_port)"
    )
    result = run(["srun", "-N1", "-n2", sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, output(result)
    lines = sorted(result.stdout.split("\n")[:-1])
    assert len(lines) == 2 and lines[0].split()[0] == "True", lines
    assert lines[0].split()[2] == lines[1].split()[2]
    assert SLURMEnvironment.detect() is False  # pytest itself is not a SLURM task
    assert ROOT.is_dir()
