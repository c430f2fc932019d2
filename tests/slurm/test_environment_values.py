"""SLURMEnvironment on variable values a one-node cluster cannot produce (several nodes,
uneven layouts), set the way SLURM writes them."""

from __future__ import annotations

import pytest

from accord.environments import SLURMEnvironment
from accord.errors import ConfigurationError

_STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NODELIST": "gpu[003-005,9]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
}


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch) -> SLURMEnvironment:
    for name in ("MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS_PER_NODE", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _STEP.items():
        monkeypatch.setenv(name, value)
    return SLURMEnvironment()


def test_a_four_node_step(step: SLURMEnvironment) -> None:
    assert SLURMEnvironment.detect()
    assert (step.global_rank(), step.local_rank(), step.node_rank()) == (5, 1, 2)
    assert step.world_size() == 8
    assert step.main_address == "gpu003"
    step.validate_settings(num_devices=2, num_nodes=4)
    assert step.restart_count() == 0


def test_steps_of_one_job_get_different_ports(
    step: SLURMEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = set()
    for step_id in range(1000):
        monkeypatch.setenv("SLURM_STEP_ID", str(step_id))
        ports.add(step.main_port)
    assert len(ports) == 1000 and all(10000 <= port < 30000 for port in ports)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    same_step = set()
    for job_id in range(5000, 25000):
        monkeypatch.setenv("SLURM_JOB_ID", str(job_id))
        same_step.add(step.main_port)
    assert len(same_step) == 20000
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert step.main_port == 29400


def test_an_uneven_layout_is_refused(
    step: SLURMEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1")
    monkeypatch.setenv("SLURM_NTASKS", "7")
    with pytest.raises(
        ConfigurationError, match=r"devices=2\) disagrees.*2\(x3\),1 tasks per node"
    ):
        step.validate_settings(num_devices=2, num_nodes=4)


def test_wrong_node_count_is_refused(step: SLURMEnvironment) -> None:
    with pytest.raises(ConfigurationError, match=r"num_nodes=2\) disagrees.*on 4 node"):
        step.validate_settings(num_devices=4, num_nodes=2)


def test_restart_count_and_a_bad_value(
    step: SLURMEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert step.restart_count() == 3
    monkeypatch.setenv("SLURM_RESTART_COUNT", "three")
    with pytest.raises(ConfigurationError, match="SLURM_RESTART_COUNT='three' is not an integer"):
        step.restart_count()


def test_requeue_without_a_job_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert SLURMEnvironment().requeue() is False
    (record,) = [r for r in caplog.records if r.name == "accord.environments.slurm"]
    assert record.levelname == "WARNING"
    assert "SLURM_JOB_ID is not set" in record.getMessage()
