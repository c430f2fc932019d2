"""A preemption signal on one rank, or on the launcher only, stops every rank at the same
step after one checkpoint; the job exits with PREEMPTED_EXIT_CODE and resumes exactly."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.callbacks import Callback
from accord.checkpoint import read_checkpoint
from accord.errors import PREEMPTED_EXIT_CODE, ConfigurationError, Preempted
from accord.launchers.launcher import FORWARDED_SIGNALS, SignalForwarder
from accord.trainer.preemption import PREEMPTION_CHECKPOINT_NAME, SignalFlag, parse_signals
from tests.helpers.models import LinearModel, loader
from tests.helpers.processes import run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "preempt_fit.py")
SIGNAL_STEP = 10
# Two epochs of eight steps, then one more: the uninterrupted run's step count.
TOTAL_STEPS = 24


def _script(root: Path, *args: str, check: bool = True) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    return run_python([SCRIPT, str(root), *args], timeout=240, check=check)


_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STRATEGIES = [
    "ddp",
    "fsdp",
    pytest.param(
        "deepspeed_stage_2",
        marks=pytest.mark.skipif(
            not _DEEPSPEED, reason="needs deepspeed: pip install 'accord[deepspeed]'"
        ),
    ),
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], torch.Tensor]:
    """The final weights of an uninterrupted run of a strategy (each run once)."""
    runs: dict[str, torch.Tensor] = {}

    def weights(strategy: str) -> torch.Tensor:
        if strategy not in runs:
            root = tmp_path_factory.mktemp(f"full_{strategy}")
            _script(root, strategy, "full")
            final = torch.load(root / "final.rank0.pt")
            assert final["global_step"] == TOTAL_STEPS
            runs[strategy] = final["weights"]
        return runs[strategy]

    return weights


def _stops(root: Path) -> list[dict[str, Any]]:
    return [json.loads((root / f"stop.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("who", ["rank1", "launcher"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_stops_every_rank_together_and_resumes_exactly(
    strategy: str, who: str, tmp_path: Path, uninterrupted: Callable[[str], torch.Tensor]
) -> None:
    result = _script(tmp_path, strategy, "signal", who, str(SIGNAL_STEP), check=False)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr
    sent = json.loads((tmp_path / "signal.json").read_text())
    stops = _stops(tmp_path)
    assert [s["type"] for s in stops] == ["Preempted", "Preempted"], stops
    step = stops[0]["step"]
    assert stops[1]["step"] == step
    # The flag is read at the next batch's decision (a signal that lands in the launcher
    # while that decision runs is read one batch later).
    assert SIGNAL_STEP < step <= SIGNAL_STEP + 2
    assert max(s["time"] for s in stops) - sent["time"] < 10
    assert "every rank stopped at step" in result.stderr

    checkpoints = tmp_path / "checkpoints"
    # One finished checkpoint at that step (a file, or FSDP's / DeepSpeed's directory),
    # nothing left half-written.
    saved = read_checkpoint(checkpoints / PREEMPTION_CHECKPOINT_NAME)
    assert saved["global_step"] == step
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]

    _script(tmp_path, strategy, "resume")
    finals = [torch.load(tmp_path / f"final.rank{r}.pt") for r in range(2)]
    assert [f["global_step"] for f in finals] == [TOTAL_STEPS, TOTAL_STEPS]
    expected = uninterrupted(strategy)
    for final in finals:
        torch.testing.assert_close(final["weights"], expected, rtol=0, atol=1e-6)


class _SignalAt(Callback):
    def __init__(self, step: int, sig: signal.Signals) -> None:
        self.step = step
        self.sig = sig

    def on_train_batch_end(
        self, trainer: accord.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(self.sig)


def _trainer(root: Path, **kwargs: Any) -> accord.Trainer:
    return accord.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        **kwargs,
    )


@pytest.mark.timeout(120)
def test_single_process_sigusr1_saves_and_raises_preempted(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    trainer = _trainer(
        tmp_path, preemption_signals=["SIGUSR1"], callbacks=[_SignalAt(3, signal.SIGUSR1)]
    )
    with pytest.raises(Preempted) as info:
        trainer.fit(LinearModel(), loader(batch_size=16))
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert info.value.step == 4
    assert "SIGUSR1" in str(info.value)
    saved = read_checkpoint(info.value.checkpoint)
    assert saved["global_step"] == 4
    # The handler the fit installed is gone again.
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.timeout(120)
def test_fit_restores_the_previous_handler_after_a_normal_fit(tmp_path: Path) -> None:
    seen: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR2, mine)
    try:
        trainer = _trainer(tmp_path, preemption_signals="USR2", limit_train_batches=2)
        trainer.fit(LinearModel(), loader(batch_size=16))
        assert signal.getsignal(signal.SIGUSR2) is mine
        assert trainer.global_step == 2
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_signal_flag_chains_to_the_previous_python_handler() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    flag = SignalFlag([signal.SIGUSR2])
    try:
        assert flag.install()
        signal.raise_signal(signal.SIGUSR2)
        assert flag.received is signal.SIGUSR2
        assert seen == [signal.SIGUSR2]
    finally:
        flag.restore()
        signal.signal(signal.SIGUSR2, previous)


def test_handlers_are_installed_from_the_main_thread_only() -> None:
    results: list[bool] = []
    flag = SignalFlag([signal.SIGUSR2])
    forwarder = SignalForwarder(list)
    thread = threading.Thread(target=lambda: results.extend([flag.install(), forwarder.install()]))
    thread.start()
    thread.join()
    assert results == [False, False]


def test_forwarder_passes_signals_on_and_restores() -> None:
    before = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    forwarder = SignalForwarder(lambda: [child.pid])
    try:
        assert forwarder.install()
        signal.raise_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        forwarder.restore()
        if child.poll() is None:
            child.kill()
    assert {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS} == before


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ()),
        ([], ()),
        ("SIGTERM", (signal.SIGTERM,)),
        (["usr1", signal.SIGTERM, int(signal.SIGUSR1)], (signal.SIGUSR1, signal.SIGTERM)),
    ],
)
def test_parse_signals(value: Any, expected: tuple[signal.Signals, ...]) -> None:
    assert parse_signals(value) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [("SIGNOPE", "not a signal"), ("SIGKILL", "cannot be handled"), (1.5, "not a signal")],
)
def test_bad_signals_are_refused_when_the_trainer_is_built(value: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        accord.Trainer(accelerator="cpu", preemption_signals=value)


class _SignalLauncherAt(Callback):
    """On rank 1, once ``global_step`` reaches ``step``, sends SIGTERM to the launcher and
    waits until the launcher has forwarded it back to this rank: the next batch's decision
    then carries it, however slowly the launcher was scheduled."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: accord.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            flag = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            assert isinstance(flag, SignalFlag), "the fit loop catches SIGTERM"
            os.kill(os.getppid(), signal.SIGTERM)
            while flag.received is None:  # the test's timeout bounds it
                time.sleep(0.01)


@pytest.mark.timeout(300)
def test_spawn_launcher_forwards_sigterm_and_raises_preempted(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, strategy="ddp_spawn", devices=2, callbacks=[_SignalLauncherAt(3)])
    with pytest.raises(Preempted) as info:
        trainer.fit(LinearModel(), loader(batch_size=16))
    assert info.value.code == PREEMPTED_EXIT_CODE
    # Rank 1 held the signal before batch 4 started: every rank stops after that step.
    assert info.value.step == 4
    saved = read_checkpoint(info.value.checkpoint)
    assert saved["global_step"] == info.value.step
    assert signal.getsignal(signal.SIGTERM) == before
