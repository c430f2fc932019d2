"""Horovod regression tests: real fits and the collective contract under horovodrun.

Every multi-rank run is a real ``horovodrun --gloo`` job on this machine's CPUs
(``scripts/horovod_fit.py`` for the fits, ``scripts/horovod_conformance.py`` for the
conformance suite); nothing of Horovod is mocked. The tests run where horovod is installed
(``make test-horovod`` builds it into ``.venv-horovod``) and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "horovod",
    reason="HorovodStrategy needs horovod: pip install 'accord[horovod]' (make test-horovod)",
)

import torch

import accord
from accord.engines.horovod.strategy import HorovodStrategy
from accord.errors import ConfigurationError
from accord.testing import assert_strategies_agree
from tests.helpers.models import LinearModel, flat_weights, loader
from tests.helpers.processes import ROOT

HERE = Path(__file__).resolve().parent
FIT = HERE / "scripts" / "horovod_fit.py"
RUNNER = HERE / "scripts" / "horovod_conformance.py"
TIMEOUT = 240.0  # per horovodrun job; below pytest's own 300 s, so the job is stopped first
RTOL, ATOL = 1e-5, 1e-6


def _horovodrun() -> str:
    beside = Path(sys.executable).with_name("horovodrun")
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if found is None:
        pytest.fail("horovod is installed but its horovodrun launcher is not on PATH")
    return found


def _run(np: int, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python args`` in ``np`` ranks under horovodrun (np=0: plain python, no launcher)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    launcher = [] if np == 0 else [_horovodrun(), "--gloo", "-np", str(np), "-H", f"localhost:{np}"]
    command = [*launcher, sys.executable, *args]
    # Its own session, so a job that hangs is stopped with every rank horovodrun started.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in {TIMEOUT:.0f} s:\n{stdout}\n{stderr}")
    result = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the job (horovodrun then stops its ranks), then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _ranks(out: Path, world_size: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _single_device(batch_size: int, **kwargs: Any) -> torch.Tensor:
    model = LinearModel()
    trainer = accord.Trainer(
        strategy="single_device",
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )
    trainer.fit(model, loader(batch_size=batch_size))
    return flat_weights(model)


# ------------------------------------------------------------------- contract
@pytest.mark.parametrize(
    "np", [2, 3, 0], ids=["horovodrun-np2", "horovodrun-np3", "python-group-of-one"]
)
def test_horovod_collective_conforms(np: int, tmp_path: Path) -> None:
    result = _run(np, [str(RUNNER), str(tmp_path)], check=False)
    world_size = max(np, 1)
    reports = {}
    for rank in range(world_size):
        path = tmp_path / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no report:\n{result.stdout}\n{result.stderr}"
        reports[rank] = json.loads(path.read_text())
    violations = [v for rank in reports for v in reports[rank]]
    assert violations == [], "\n".join(
        f"[{v['check']}] world_size={v['world_size']} rank={v['rank']}: {v['message']}"
        for v in violations
    )
    assert result.returncode == 0, result.stderr


def test_dtypes_horovod_lacks_are_reduced_and_moved_exactly(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "dtypes"])
    bf16 = [torch.tensor([1.5, -2.0], dtype=torch.bfloat16) * (r + 1) for r in range(2)]
    for rank, result in enumerate(_ranks(tmp_path, 2)):
        expected = {
            # Narrow integers wrap around as a reduction in their own type would.
            "u8 sum": torch.tensor([(200 + 201) % 256, 7], dtype=torch.uint8),
            "u8 max": torch.tensor([201, 4], dtype=torch.uint8),
            "i8 sum": torch.tensor([-100, 5], dtype=torch.int8)
            + torch.tensor([-150 + 256, -45], dtype=torch.int8),
            "bf16 sum": bf16[0] + bf16[1],
            "bf16 all_gather": torch.stack(bf16),
            "bf16 all_to_all": torch.stack([bf16[0][rank], bf16[1][rank]]),
            "complex sum": torch.tensor([3 + 6j, 9j]),
            "complex broadcast": torch.tensor([2 + 4j, 6j]),
            "int32 reduce_scatter": (torch.arange(4, dtype=torch.int32) * 2 + 1)[2 * rank :][:2],
        }
        for name, value in expected.items():
            assert result[name].dtype == value.dtype, name
            assert torch.equal(result[name], value), (name, result[name], value)


# ----------------------------------------------------------------------- fits
def test_fits_under_horovodrun_match_one_device_and_agree(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "fit"])
    results = _ranks(tmp_path, 2)
    references = {
        # The same global batch (2 ranks x 16) on one device: batch 32.
        "plain": (_single_device(32), 16, 1),
        "accumulate": (_single_device(32, accumulate_grad_batches=2), 8, 2),
        "clip": (_single_device(32, gradient_clip_val=0.5), 16, 1),
    }
    for name, (reference, steps, passes) in references.items():
        for rank, per_rank in enumerate(results):
            run = per_rank[name]
            assert run["hvd"] == (rank, 2, rank)
            assert run["strategy"] == run["hvd"]
            assert run["sampler"] == {"num_replicas": 2, "rank": rank}
            assert run["collective"] == "HorovodCollective"
            assert run["optimizer"] == "horovod.torch.optimizer"
            assert run["passes"] == passes
            assert run["global_step"] == steps
            losses = run["losses"]
            if name == "clip":  # clipped at 0.5, the descent is slower: compare the epochs
                half = len(losses) // 2
                assert sum(losses[half:]) < sum(losses[:half]), losses
            else:
                assert losses[-1] < losses[0] / 4, (name, losses)
            torch.testing.assert_close(run["weights"], results[0][name]["weights"], rtol=0, atol=0)
            assert run["train_loss"] == results[0][name]["train_loss"]
        torch.testing.assert_close(results[0][name]["weights"], reference, rtol=RTOL, atol=ATOL)


class AgreeNet(accord.Module):
    """Two layers and SGD with momentum, for `assert_strategies_agree` (importable by ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def agree_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(-1) + 0.1 * torch.randn(32, generator=generator))


def test_horovod_agrees_with_one_device_through_the_equivalence_kit() -> None:
    # The kit runs its worker under `horovodrun --gloo -np 2` (HorovodStrategy's
    # external_launch_command), with AgreeNet and agree_data pickled by reference.
    records = assert_strategies_agree(AgreeNet, agree_data, ["horovod"], steps=3, timeout=TIMEOUT)
    assert list(records) == ["single_device", "horovod"]
    assert records["horovod"].samples == [list(range(8 * k, 8 * k + 8)) for k in range(3)]


def test_horovod_is_started_by_horovodrun() -> None:
    command = HorovodStrategy().external_launch_command(3)
    assert command is not None
    assert Path(command[0]).name == "horovodrun"
    assert command[1:] == ["--gloo", "-np", "3", "-H", "localhost:3"]


def test_true_and_mixed_precisions_train_a_float32_dataset_and_the_ranks_agree(
    tmp_path: Path,
) -> None:
    _run(2, [str(FIT), str(tmp_path), "precision"])
    results = _ranks(tmp_path, 2)
    # The true modes convert the parameters and the batches; bf16-mixed keeps both in
    # float32 and computes under autocast.
    dtypes = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "bf16-mixed": torch.float32}
    for precision, dtype in dtypes.items():
        for result in (per_rank[precision] for per_rank in results):
            assert result["param_dtypes"] == {dtype}
            assert result["batch_dtypes"] == {dtype}
            assert result["global_step"] == 12  # 8 batches per rank and epoch, in pairs, 3 epochs
            # Clipped at 0.5 with lr 0.1 a step moves the weights by 0.05 at most: compare
            # the first epoch's losses with the third's.
            losses = result["losses"]
            assert sum(losses[-8:]) < 0.85 * sum(losses[:8]), (precision, losses)
            torch.testing.assert_close(
                result["weights"], results[0][precision]["weights"], rtol=0, atol=0
            )


def test_16_mixed_is_refused_on_cpu_with_what_works_instead() -> None:
    with pytest.raises(ConfigurationError, match=r"needs a CUDA device.*'bf16-mixed'"):
        accord.Trainer(strategy="horovod", precision="16-mixed", accelerator="cpu", logger=False)


def test_plain_python_is_a_horovod_group_of_one(tmp_path: Path) -> None:
    _run(0, [str(FIT), str(tmp_path), "fit"])
    (run,) = (result["plain"] for result in _ranks(tmp_path, 1))
    assert run["hvd"] == (0, 1, 0)
    assert run["sampler"] == {"num_replicas": 1, "rank": 0}
    assert run["global_step"] == 2 * 256 // 16
    torch.testing.assert_close(run["weights"], _single_device(16), rtol=RTOL, atol=ATOL)


def test_checkpoint_resume_continues_the_same_fit(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "resume"])
    results = _ranks(tmp_path, 2)
    for result in results:
        assert result["checkpoint_exists"]
        assert result["resumed_step"] == 3 * 8
        # Resuming from epoch 0's checkpoint (weights and momentum) ends where the
        # uninterrupted fit ends, and elsewhere than the first epoch alone.
        torch.testing.assert_close(result["resumed"], result["straight"], rtol=RTOL, atol=ATOL)
        assert not torch.allclose(result["after_first_epoch"], result["straight"])
        torch.testing.assert_close(result["resumed"], results[0]["resumed"], rtol=0, atol=0)


def test_ranks_agree_on_decisions_and_early_stopping(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "agree"])
    for result in _ranks(tmp_path, 2):
        # Rank 1 logs 1.0, 0.5, 0.5, ...: no improvement at epochs 2 and 3, so with
        # patience=2 it asks to stop after epoch 3; rank 0 keeps improving but stops with it.
        assert result["stopped_after_epochs"] == 4
        assert (result["any"], result["all"], result["every"]) == (True, False, True)
        assert result["gather"] == [0, 0, 1]
        assert result["mean"] == 0.5
        assert result["object"] == {"from": 1}


def test_uneven_batches_join_and_end_with_the_same_model(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "uneven"])
    results = _ranks(tmp_path, 2)
    assert [r["batches"] for r in results] == [5, 3]
    # Each rank counts its own optimizer steps; rank 1 joined early in each epoch.
    assert [r["global_step"] for r in results] == [15, 9]
    for result in results:
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
        assert result["train_loss"] == results[0]["train_loss"]
        assert result["losses"][-1] < result["losses"][0]


def test_a_collective_subclass_carries_horovods_own_operations(tmp_path: Path) -> None:
    _run(2, [str(FIT), str(tmp_path), "custom"])
    results = _ranks(tmp_path, 2)
    for rank, result in enumerate(results):
        uneven, debug = result["uneven"], result["debug"]
        steps = 2 * (5 - 2 * rank)  # one optimizer step per batch, 2 epochs
        assert uneven["global_step"] == steps
        # One wrap and one broadcast each at setup; after each epoch's join the ranks
        # stepped differently, so the rank that stepped most broadcasts again.
        assert uneven["calls"] == {
            "broadcast_module": 3,
            "distributed_optimizer": 1,
            "broadcast_optimizer_state": 3,
            "synchronize": steps,
            "join": 2,
        }
        torch.testing.assert_close(
            uneven["weights"], results[0]["uneven"]["weights"], rtol=0, atol=0
        )
        # Through the debug wrapper the strategy still reaches the subclass's methods.
        assert debug["outer"] == "DebugCollective"
        assert debug["calls"] == {
            "broadcast_module": 1,
            "distributed_optimizer": 1,
            "broadcast_optimizer_state": 1,
            "synchronize": 8,
            "join": 2,
        }
        torch.testing.assert_close(debug["weights"], results[0]["debug"]["weights"], rtol=0, atol=0)


def test_a_collective_of_another_engine_is_refused_before_it_is_set_up() -> None:
    from accord.collectives import TorchCollective

    strategy = HorovodStrategy(collective=TorchCollective())
    trainer = accord.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigurationError, match="needs a HorovodCollective"):
        trainer.fit(LinearModel(), loader(batch_size=16))
    assert not strategy.collective.is_setup


# ---------------------------------------------------------------- configuration
def test_devices_above_one_from_a_plain_script_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match=r"horovodrun -np 2 python \S+"):
        accord.Trainer(strategy="horovod", devices=2, accelerator="cpu", logger=False)
    with pytest.raises(ConfigurationError, match=r"horovodrun -np 6 -H host1:3"):
        accord.Trainer(strategy="horovod", devices=3, num_nodes=2, accelerator="cpu")


def test_backward_passes_per_step_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="backward_passes_per_step"):
        HorovodStrategy(backward_passes_per_step=0)


def test_importing_accord_and_building_the_strategy_does_not_import_horovod() -> None:
    code = (
        "import sys, accord\n"
        "from accord.engines.horovod.strategy import HorovodStrategy\n"
        "strategy = accord.strategies.StrategyRegistry.get('horovod').build()\n"
        "assert isinstance(strategy, HorovodStrategy)\n"
        "assert strategy.collective.backend_name == 'horovod'\n"
        "assert not any(m.split('.')[0] == 'horovod' for m in sys.modules), 'imported'\n"
    )
    _run(0, ["-c", code])


# ------------------------------------------------- checkpoints between strategies
# tests/reliability/test_resume_matrix.py's fit (Adam, an LR halved every epoch, a global
# batch of 24: 2 ranks x 12 under horovod, 24 on one device), saved mid-epoch (step 6 of
# 12, by ModelCheckpoint(every_n_train_steps=6)) under one strategy and resumed under the
# other: it ends with the uninterrupted run's weights, and the samples seen before and
# after the save are the uninterrupted run's. Resuming under horovod also checks that the
# scheduler, built on the original optimizer, still changes the LR Horovod's wrapper uses
# after the optimizer state is loaded into the wrapper.
MOVE = HERE / "scripts" / "horovod_resume.py"
MOVE_SAMPLES, MOVE_SAVE_STEP = 96, 6


def _move(out: Path, tag: str, strategy: str, mode: str | Path) -> list[dict[str, Any]]:
    """One fit of ``horovod_resume.py``; what each of its ranks measured."""
    np = 2 if strategy == "horovod" else 0
    _run(np, [str(MOVE), str(out), tag, strategy, str(mode)])
    return [torch.load(out / f"{tag}-rank{r}.pt", weights_only=False) for r in range(max(np, 1))]


def _seen(ranks: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [pair for rank in ranks for pair in rank["seen"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (run,) = _move(tmp_path_factory.mktemp("uninterrupted"), "full", "single_device", "full")
    assert run["global_step"] == 12
    return run


def _same_fit(
    resumed: list[dict[str, Any]], saved: list[dict[str, Any]], full: dict[str, Any]
) -> None:
    for rank in resumed:
        assert rank["global_step"] == full["global_step"]
        assert rank["weights"].keys() == full["weights"].keys()
        for key, value in full["weights"].items():
            torch.testing.assert_close(rank["weights"][key], value, rtol=1e-5, atol=1e-5)
    assert Counter(_seen(saved) + _seen(resumed)) == Counter(full["seen"])
    # Half of epoch 1 before the save, the other half after it, each sample once.
    assert Counter(e for e, _ in _seen(saved)) == {0: MOVE_SAMPLES, 1: MOVE_SAMPLES // 2}


def test_a_horovod_checkpoint_resumes_on_one_device(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    saved = _move(tmp_path, "saved", "horovod", "SAVE")
    checkpoint = tmp_path / "saved" / "saved.ckpt"
    resumed = _move(tmp_path, "resumed", "single_device", checkpoint)
    _same_fit(resumed, saved, uninterrupted)
    # The checkpoint says who wrote it (python -m accord.checkpoint inspect).
    result = _run(0, ["-m", "accord.checkpoint", "inspect", str(checkpoint)])
    assert "written by:  HorovodStrategy, world size 2" in result.stdout, result.stdout
    assert "layout:      full" in result.stdout
    assert f"epoch 1, global step {MOVE_SAVE_STEP}, mid-epoch" in result.stdout
    assert f"48 of the epoch's {MOVE_SAMPLES} samples consumed" in result.stdout


def test_a_one_device_checkpoint_resumes_under_horovod(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    saved = _move(tmp_path, "saved", "single_device", "SAVE")
    resumed = _move(tmp_path, "resumed", "horovod", tmp_path / "saved" / "saved.ckpt")
    _same_fit(resumed, saved, uninterrupted)


def test_a_horovod_checkpoint_resumes_under_horovod(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    saved = _move(tmp_path, "saved", "horovod", "SAVE")
    resumed = _move(tmp_path, "resumed", "horovod", tmp_path / "saved" / "saved.ckpt")
    _same_fit(resumed, saved, uninterrupted)
