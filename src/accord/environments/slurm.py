"""`SLURMEnvironment`: processes started by ``srun`` under a SLURM allocation."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

from typing_extensions import override

from accord.core.env_vars import env_number
from accord.environments.cluster_environment import _RanksFromVariables
from accord.errors import ConfigurationError

__all__ = ["SLURMEnvironment"]

_log = logging.getLogger(__name__)


class SLURMEnvironment(_RanksFromVariables):
    """Ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``; one task per device.

    The main address is the first host of ``SLURM_NODELIST``; the port is ``MASTER_PORT``
    if set, else derived from the job id and the step id, so every task of a step computes
    the same one and steps that run at the same time (two ``srun`` in one job, the tasks of
    a job array) get different ones.
    """

    _world_size_variable = "SLURM_NTASKS"
    _global_rank_variable = "SLURM_PROCID"
    _local_rank_variable = "SLURM_LOCALID"
    _node_rank_variable = "SLURM_NODEID"

    @property
    @override
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        return first_host(os.environ.get("SLURM_NODELIST", "127.0.0.1"))

    @property
    @override
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        job_id = _int_variable("SLURM_JOB_ID", 0)
        step_id = _int_variable("SLURM_STEP_ID", 0)
        # Job ids are unique per cluster (each task of an array has its own); a job's
        # concurrent steps differ in their step id. The prime step stride is coprime with
        # the range, so a job's steps never share a port, nor do jobs under 20000 apart
        # at the same step.
        return _PORT_BASE + (job_id + step_id * _STEP_STRIDE) % _PORT_RANGE

    @staticmethod
    @override
    def detect() -> bool:
        # An interactive `salloc` shell also has SLURM_NTASKS; srun tasks have SLURM_STEP_ID.
        return "SLURM_NTASKS" in os.environ and "SLURM_STEP_ID" in os.environ

    @override
    def restart_count(self) -> int:
        """``SLURM_RESTART_COUNT``: how often SLURM requeued and restarted the job (0 first)."""
        return _int_variable("SLURM_RESTART_COUNT", 0)

    @override
    def requeue(self) -> bool:
        """Run ``scontrol requeue $SLURM_JOB_ID``; whether SLURM accepted it.

        SLURM then ends the job's running steps and starts the batch script again, with
        ``SLURM_RESTART_COUNT`` one higher, once its ``BeginTime`` is reached (the
        cluster's ``AuthInfo=cred_expire``, 120 s by default). Only a batch job that may be
        requeued (``sbatch --requeue``, or the cluster's ``JobRequeue=1``) can be; when
        SLURM refuses, or ``scontrol`` is missing, this says why on stderr and returns
        False.
        """
        job_id = os.environ.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            return _requeue_failed("SLURM_JOB_ID is not set, so there is no job to requeue")
        if shutil.which("scontrol") is None:
            return _requeue_failed("scontrol is not on PATH on this node")
        # scontrol runs inside the job step, so the requeue it asks for SIGTERMs it too,
        # sometimes before it exits: it ignores SIGTERM (SLURM's SIGKILL comes KillWait later).
        command = ["sh", "-c", 'trap "" TERM; exec scontrol requeue "$1"', "sh", job_id]
        shown = f"scontrol requeue {job_id}"
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=60, check=False
            )
        except subprocess.TimeoutExpired:
            return _requeue_failed(f"{shown} did not finish within 60 s")
        if result.returncode < 0:
            return _requeue_failed(
                f"{shown} was killed by signal {-result.returncode} before it answered; "
                "check `scontrol show job` for whether the job was requeued"
            )
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            return _requeue_failed(
                f"{shown} failed: {said}. Only batch jobs submitted with "
                "`sbatch --requeue` (or on a cluster with JobRequeue=1) can be requeued; "
                "resubmit the job to continue from the checkpoint"
            )
        return True

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        nodes = _int_variable("SLURM_STEP_NUM_NODES", _int_variable("SLURM_NNODES", 0))
        if nodes and nodes != num_nodes:
            raise ConfigurationError(
                f"Trainer(num_nodes={num_nodes}) disagrees with the SLURM job step, which runs "
                f"on {nodes} node(s) (SLURM_STEP_NUM_NODES). Pass num_nodes={nodes}, or "
                f"srun --nodes={num_nodes}."
            )
        per_node = _tasks_per_node()
        if per_node is not None and any(count != num_devices for count in per_node):
            flag = os.environ.get("SLURM_NTASKS_PER_NODE")
            layout = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or str(per_node[0])
            asked = f"--ntasks-per-node={flag}" if flag else f"{layout} tasks per node"
            raise ConfigurationError(
                f"Trainer(devices={num_devices}) disagrees with the SLURM job step's {asked} "
                f"(SLURM_STEP_TASKS_PER_NODE={layout}). "
                "Start one SLURM task per device: pass devices equal to --ntasks-per-node, "
                "or srun --ntasks-per-node equal to devices."
            )
        if num_nodes * num_devices != self.world_size():
            raise ConfigurationError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) needs "
                f"{num_devices * num_nodes} SLURM tasks, but SLURM_NTASKS={self.world_size()}. "
                "Start one SLURM task per device (srun --ntasks-per-node=devices)."
            )


_PORT_BASE = 10000
_PORT_RANGE = 20000
_STEP_STRIDE = 4099


def _int_variable(name: str, default: int) -> int:
    return env_number(
        name, int, default, hint="SLURM sets it. Unset it, or start the job with srun"
    )


def _requeue_failed(reason: str) -> bool:
    _log.warning("SLURMEnvironment: the job was not requeued: %s.", reason)
    return False


def _tasks_per_node() -> list[int] | None:
    """The step's task count per node, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``),
    else ``SLURM_NTASKS_PER_NODE``; None when neither says."""
    layout = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    if not layout:
        flag = os.environ.get("SLURM_NTASKS_PER_NODE", "").strip()
        return [int(flag)] if flag.isdigit() else None
    counts: list[int] = []
    for part in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list such as ``gpu[003-005,9],cpu1``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^(.*?)\[(\d+)", first)
    return f"{match.group(1)}{match.group(2)}" if match else first
