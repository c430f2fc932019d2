"""``Trainer(on_rank_loss="continue")``: a four-rank ddp fit (Adam, a step LR scheduler,
shuffled data, 200 steps) loses ranks on the way, killed, frozen or preempted at chosen
points, and finishes without a restart, with the final weights of the uninterrupted run
(within 1e-5 relative), every sample of every epoch trained on exactly once, and no process
left behind. A replacement rank (accord's launcher or torchrun restarting it) rejoins and
the run ends on four ranks. Every fit is a real one (`scripts/rank_loss_fit.py`) in its own
processes over gloo."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from accord import Trainer
from accord.errors import ConfigurationError
from accord.strategies import DDPStrategy
from tests.helpers.processes import ROOT, run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "rank_loss_fit.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 200
EPOCH_SAMPLES = 800


def _fit(out: Path, *kills: str, env: dict[str, str] | None = None) -> str:
    """Run the fit into ``out`` with ``kills`` (``RANK:STEP:WHERE``); its output."""
    out.mkdir(parents=True, exist_ok=True)
    result = run_python([SCRIPT, str(out), *kills], timeout=300, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def _torchrun(out: Path, *kills: str, extra: tuple[str, ...] = ()) -> str:
    out.mkdir(parents=True, exist_ok=True)
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["FIT_SLOW"] = "0.03" if extra else "0"
    result = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "4", *extra, SCRIPT, str(out), *kills],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=out,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the uninterrupted fit."""
    out = tmp_path_factory.mktemp("reference")
    _fit(out)
    return torch.load(out / "final.pt")


def _check(out: Path, output: str, reference: dict[str, torch.Tensor], world: int) -> None:
    """The run ended on ``world`` ranks with the reference's weights, trained on every
    sample of every epoch once, and left no process behind."""
    assert f"DONE {world} {STEPS}" in output, output
    final = torch.load(out / "final.pt")
    for name, expected in reference.items():
        error = (final[name] - expected).abs().max() / expected.abs().max()
        assert error < 1e-5, f"{name}: relative difference {error:.2e}\n{output}"
    seen: dict[int, list[int]] = collections.defaultdict(list)
    steps: dict[int, set[int]] = collections.defaultdict(set)
    for record in out.glob("seen.*.jsonl"):
        for line in record.read_text().splitlines():
            epoch, step, samples = json.loads(line)
            seen[epoch] += samples
            steps[epoch].add(step)
    assert len(seen) == STEPS * 32 // EPOCH_SAMPLES
    for epoch, samples in seen.items():
        repeated = [s for s, n in collections.Counter(samples).items() if n > 1]
        assert not repeated, f"epoch {epoch}: samples {repeated[:10]} trained on twice"
        assert sorted(samples) == list(range(EPOCH_SAMPLES)), f"epoch {epoch} missed samples"
        assert len(steps[epoch]) == EPOCH_SAMPLES // 32
    _no_process_left(out)


def _no_process_left(out: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
        if not left.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left.strip(), f"processes left behind: {left}"


def _announced(output: str) -> list[str]:
    return re.findall(r"rank \d .*(?:lost|rejoined) at step \d+; continuing with .*", output)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "kill",
    ["1:23:forward", "3:49:backward", "2:20:validation", "2:24:save"],
    ids=["forward", "backward-all-reduce", "validation", "save"],
)
def test_a_killed_rank_changes_no_number(
    tmp_path: Path, reference: dict[str, torch.Tensor], kill: str
) -> None:
    output = _fit(tmp_path, kill)
    rank, step, _ = kill.split(":")
    (said,) = _announced(output)
    assert said.startswith(f"rank {rank} (SIGKILL) lost at step {step}; continuing with 3 ranks")
    assert "global batch kept at 32" in said
    _check(tmp_path, output, reference, world=3)


@pytest.mark.timeout(400)
def test_two_losses_in_one_run(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    output = _fit(tmp_path, "1:17:backward", "3:120:forward", env={"FIT_PROFILER": "timeline"})
    assert len(_announced(output)) == 2, output
    # The collective timeline shows each change of members.
    timeline = (tmp_path / "collective-timeline-fit.json").read_text()
    assert "regroup rank 1 (SIGKILL) lost: members 0, 2, 3" in timeline
    assert "regroup rank 3 (SIGKILL) lost: members 0, 2" in timeline
    _check(tmp_path, output, reference, world=2)


@pytest.mark.timeout(400)
def test_a_frozen_rank_is_dropped_after_the_timeout(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    env = {"FIT_SIGNAL": "STOP", "ACCORD_COLLECTIVE_TIMEOUT": "10"}
    output = _fit(tmp_path, "2:30:forward", env=env)
    (said,) = _announced(output)
    assert said.startswith("rank 2 (stopped answering) lost at step 30"), output
    _check(tmp_path, output, reference, world=3)


@pytest.mark.timeout(400)
def test_rank_0_may_be_lost_under_ddp_spawn(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    output = _fit(tmp_path, "0:23:forward", env={"FIT_STRATEGY": "ddp_spawn"})
    assert "rank 0 (SIGKILL) lost at step 23" in output, output
    _check(tmp_path, output, reference, world=3)


@pytest.mark.timeout(400)
def test_a_replacement_rejoins_under_accords_launcher(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    output = _fit(tmp_path, "2:15:forward", env={"FIT_RESTARTS": "1", "FIT_SLOW": "0.05"})
    assert re.search(r"rank 2 rejoined at step \d+; continuing with 4 ranks \(3 before\)", output)
    _check(tmp_path, output, reference, world=4)


@pytest.mark.timeout(400)
def test_under_torchrun_rank_0_may_be_lost(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    output = _torchrun(tmp_path / "run", "0:23:forward")
    assert "rank 0 (SIGKILL) lost at step 23" in output, output
    _check(tmp_path / "run", output, reference, world=3)


@pytest.mark.timeout(400)
def test_under_torchrun_max_restarts_the_replacement_rejoins(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    output = _torchrun(tmp_path / "run", "2:15:forward", extra=("--max-restarts", "1"))
    assert re.search(r"rank 2 rejoined at step \d+; continuing with 4 ranks", output), output
    _check(tmp_path / "run", output, reference, world=4)


@pytest.mark.timeout(500)
def test_a_preemption_during_a_loss_still_saves_and_resumes(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    first = tmp_path / "first"
    first.mkdir()
    result = run_python([SCRIPT, str(first), "2:30:forward", "1:30:term"], timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 75, output
    saved = first / "ckpt" / "preempted.ckpt"
    assert saved.exists(), output
    _no_process_left(first)
    second = tmp_path / "second"
    output = _fit(second, env={"FIT_CKPT": str(saved)})
    assert f"DONE 4 {STEPS}" in output
    final = torch.load(second / "final.pt")
    for name, expected in reference.items():
        assert torch.allclose(final[name], expected, rtol=1e-5, atol=1e-7), name


@pytest.mark.timeout(1800)
def test_chaos_random_losses_change_no_number(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Runs that each kill a random rank (not 0, which serves the store under accord's
    launcher) at a random step and point; ``ACCORD_CHAOS_RUNS`` sets how many (3), and
    ``ACCORD_CHAOS_SEED`` the choices (a failure names the seed that replays it)."""
    runs = int(os.environ.get("ACCORD_CHAOS_RUNS", "3"))
    seed = int(os.environ.get("ACCORD_CHAOS_SEED", str(time.time_ns())))
    chooser = random.Random(seed)
    print(f"ACCORD_CHAOS_SEED={seed} replays these runs")  # shown with a failure
    for run in range(runs):
        where = chooser.choice(["forward", "backward", "validation", "save"])
        if where == "validation":  # after batches 10 and 20 of each 25-step epoch
            step = 25 * chooser.randint(0, STEPS // 25 - 1) + chooser.choice([10, 20])
        else:  # a save every 8 steps
            every = 8 if where == "save" else 1
            step = every * chooser.randint(1, (STEPS - 10) // every)
        kill = f"{chooser.randint(1, 3)}:{step}:{where}"
        out = tmp_path / f"run{run}"
        print(f"run {run}: {kill}")
        output = _fit(out, kill)
        assert len(_announced(output)) == 1, (
            f"ACCORD_CHAOS_SEED={seed}, run {run}: {kill}\n{output}"
        )
        _check(out, output, reference, world=3)


def test_sharded_strategies_refuse_continue() -> None:
    sharded = ["fsdp"]
    if importlib.util.find_spec("deepspeed") is not None:
        sharded.append("deepspeed_stage_2")
    for strategy in sharded:
        with pytest.raises(ConfigurationError, match="cannot go on without a rank"):
            Trainer(strategy=strategy, accelerator="cpu", devices=2, on_rank_loss="continue")


def test_unknown_mode_and_restarts_without_continue_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="is not known"):
        Trainer(accelerator="cpu", on_rank_loss="retry")
    with pytest.raises(ConfigurationError, match="on_rank_loss='continue'"):
        Trainer(strategy=DDPStrategy(max_restarts=1), accelerator="cpu", devices=2)
    with pytest.raises(ConfigurationError, match="start_method='popen'"):
        DDPStrategy(start_method="spawn", max_restarts=1)
