"""DeepSpeed regression tests: real fits through real DeepSpeed engines over gloo.

Every multi-rank test runs its fits in two real processes (`run_distributed`); nothing of
DeepSpeed or torch.distributed is mocked. The first engine on a machine compiles
DeepSpeed's shared-memory extension (about 45 s, cached in ``$TORCH_EXTENSIONS_DIR``), so
the first timeouts allow for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import accord
from accord.collectives import DeepSpeedCollective
from accord.errors import CheckpointError, ConfigurationError, RankFailureError
from accord.strategies import DDPStrategy, DeepSpeedStrategy, consolidate_deepspeed_checkpoint
from accord.testing import run_distributed
from tests.helpers.models import LinearModel, flat_weights, loader
from tests.helpers.processes import run_python

SCRIPT = str(Path(__file__).parent / "scripts" / "fit.py")
TIMEOUT = 240.0  # generous: a job may include the one-time extension build

# fp32 ZeRO reduce-scatters where DDP all-reduces: same math, other summation order.
RTOL, ATOL = 1e-5, 1e-6

NAMES = [
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
]


@pytest.fixture(scope="module")
def deepspeed() -> Any:
    """Skip the test when deepspeed is not installed (the import is the only check)."""
    return pytest.importorskip(
        "deepspeed", reason="DeepSpeedStrategy needs deepspeed: pip install 'accord[deepspeed]'"
    )


def _trainer(strategy: str | accord.strategies.Strategy, **kwargs: Any) -> accord.Trainer:
    """A two-rank CPU Trainer without logs or progress bar.

    Every fit of one `run_distributed` call meets on that call's port: the process keeps
    one rendezvous store per port, and each new group gets a prefix of its own on it.
    """
    settings: dict[str, Any] = {
        "devices": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        **kwargs,
    }
    return accord.Trainer(strategy=strategy, **settings)


def test_missing_deepspeed_says_how_to_install() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        sys.modules["deepspeed"] = None  # as if it were not installed
        import accord
        from accord.errors import MissingDependencyError
        try:
            accord.Trainer(strategy="deepspeed", accelerator="cpu", logger=False)
        except MissingDependencyError as err:
            print(json.dumps({"error": str(err), "imported": "deepspeed" in sys.modules}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "DeepSpeedStrategy" in result["error"]
    assert "pip install 'accord[deepspeed]'" in result["error"]


def test_options_are_validated_before_any_run(tmp_path: Path, deepspeed: Any) -> None:
    with pytest.raises(ConfigurationError, match="either config="):
        DeepSpeedStrategy(stage=3, config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigurationError, match="needs ZeRO stage 3"):
        DeepSpeedStrategy(stage=2, offload_parameters=True)
    with pytest.raises(ConfigurationError, match="use 1, 2 or 3"):
        DeepSpeedStrategy(stage=0)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "steps_per_print": 5}))
    assert DeepSpeedStrategy(config=path).zero_stage == 3
    assert DeepSpeedStrategy(config=str(path)).config["steps_per_print"] == 5
    strategy = DeepSpeedStrategy(zero_optimization={"overlap_comm": False})
    assert strategy.config["zero_optimization"] == {"overlap_comm": False, "stage": 2}
    stages = {}
    for name in NAMES:
        strategy = accord.strategies.StrategyRegistry.get(name).build()
        assert isinstance(strategy, DeepSpeedStrategy)
        stages[name] = strategy.zero_stage
    assert stages == {
        "deepspeed": 2,
        "deepspeed_stage_1": 1,
        "deepspeed_stage_2": 2,
        "deepspeed_stage_2_offload": 2,
        "deepspeed_stage_3": 3,
        "deepspeed_stage_3_offload": 3,
    }


# ------------------------------------------------------------------ fits (one job)
def _parity_fits() -> dict[str, Any]:
    """The same seed, data, SGD, accumulation (3, with a short last window) and clipping."""
    results: dict[str, Any] = {}
    runs: list[tuple[str, str, float | None]] = [
        ("ddp", "ddp", None),
        ("ddp_clip", "ddp", 0.5),
        ("stage_1", "deepspeed_stage_1", None),
        ("stage_2", "deepspeed_stage_2", None),
        ("stage_3", "deepspeed_stage_3", None),
        ("stage_2_clip", "deepspeed_stage_2", 0.5),
    ]
    for key, name, clip in runs:
        model = LinearModel()
        trainer = _trainer(name, max_epochs=2, accumulate_grad_batches=3, gradient_clip_val=clip)
        trainer.fit(model, loader(batch_size=16))
        results[key] = {
            "weights": flat_weights(model),
            "steps": trainer.global_step,
            "losses": model.losses,
            "config": getattr(trainer.strategy, "engine_config", None),
        }
    return results


def _short_fits() -> dict[str, Any]:
    """Two steps on one batch per rank for every name (and bf16, and a config optimizer)."""
    results: dict[str, Any] = {}
    runs: list[tuple[str, str | DeepSpeedStrategy, str]] = [
        (name, name, "32-true") for name in NAMES
    ]
    runs.append(("bf16", "deepspeed", "bf16-mixed"))
    adam = {"type": "Adam", "params": {"lr": 0.05}}
    runs.append(("config_adam", DeepSpeedStrategy(optimizer=adam), "32-true"))
    for key, strategy, precision in runs:
        model = LinearModel()
        trainer = _trainer(strategy, max_epochs=2, precision=precision)
        trainer.fit(model, loader(batch_size=16, samples=32))
        results[key] = {
            "steps": trainer.global_step,
            "losses": model.losses,
            "dtype": next(model.parameters()).dtype,
            "shape": tuple(model.layer.weight.shape),
            "config": getattr(trainer.strategy, "engine_config", None),
        }
    return results


def _fits(rank: int, world_size: int) -> dict[str, Any]:
    return {"parity": _parity_fits(), "short": _short_fits()}


@pytest.fixture(scope="module")
def fits(deepspeed: Any) -> list[dict[str, Any]]:
    """Every fit of the two tests below, in one pair of processes (saves the start-ups)."""
    return run_distributed(_fits, 2, timeout=TIMEOUT)


def test_fits_match_ddp_and_the_loss_decreases(fits: list[dict[str, Any]]) -> None:
    ranks = [result["parity"] for result in fits]
    for result in ranks:
        # 8 batches per rank and epoch, windows of 3, 3 and 2: 3 steps per epoch.
        assert {run["steps"] for run in result.values()} == {6}
        for key in ("stage_1", "stage_2", "stage_3"):
            torch.testing.assert_close(
                result[key]["weights"], result["ddp"]["weights"], rtol=RTOL, atol=ATOL
            )
            assert result[key]["losses"][-1] < result[key]["losses"][0] / 2
        torch.testing.assert_close(
            result["stage_2_clip"]["weights"], result["ddp_clip"]["weights"], rtol=RTOL, atol=ATOL
        )
        # Clipping changed the result, so the comparison above is not vacuous.
        assert not torch.allclose(result["ddp_clip"]["weights"], result["ddp"]["weights"])
        torch.testing.assert_close(ranks[1]["stage_3"]["weights"], result["stage_3"]["weights"])
    config = ranks[0]["stage_2"]["config"]
    assert config["gradient_accumulation_steps"] == 3
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's own default would clip to 1.0
    assert config["zero_allow_untested_optimizer"] is True
    assert ranks[0]["stage_2_clip"]["config"]["gradient_clipping"] == 0.5


def test_every_registered_name_starts_a_fit(fits: list[dict[str, Any]]) -> None:
    result = fits[0]["short"]
    for key, run in result.items():
        assert run["steps"] == 2, key
        assert run["shape"] == (1, 8), key  # ZeRO-3 gave the full weights back
        assert run["losses"][1] < run["losses"][0], key  # the same batch, one step later
    assert result["deepspeed_stage_2_offload"]["config"]["zero_optimization"][
        "offload_optimizer"
    ] == {"device": "cpu"}
    zero3 = result["deepspeed_stage_3_offload"]["config"]["zero_optimization"]
    assert zero3["offload_param"] == {"device": "cpu"} and zero3["stage"] == 3
    assert result["bf16"]["config"]["bf16"] == {"enabled": True}
    assert result["bf16"]["dtype"] == torch.bfloat16  # DeepSpeed trains bf16 weights
    assert result["config_adam"]["config"]["optimizer"]["params"]["torch_adam"] is True


# ------------------------------------------------------------------- launchers
def _single_device_weights() -> torch.Tensor:
    """The same global batch (2 ranks x 16) on one device; DDP matches it (test_ddp)."""
    model = LinearModel()
    trainer = accord.Trainer(
        strategy="single_device",
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=32))
    return flat_weights(model)


def test_popen_relaunches_the_script(deepspeed: Any, tmp_path: Path) -> None:
    run_python([SCRIPT, str(tmp_path), "deepspeed", "2", "1"], timeout=TIMEOUT)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for result in results:
        assert (result["world_size"], result["global_step"]) == (2, 16)
        torch.testing.assert_close(result["weights"], results[0]["weights"], rtol=0, atol=0)
    expected = _single_device_weights()
    torch.testing.assert_close(results[0]["weights"], expected, rtol=RTOL, atol=ATOL)


def test_spawn_brings_the_zero3_weights_home(deepspeed: Any) -> None:
    model = LinearModel()
    strategy = DeepSpeedStrategy(stage=3, start_method="spawn")
    trainer = accord.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(batch_size=16))
    # Rank 0 gathered the partitioned parameters before sending them to this process.
    assert trainer.global_step == 16
    torch.testing.assert_close(flat_weights(model), _single_device_weights(), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------- checkpoints
class AdamModel(LinearModel):
    """Adam keeps per-parameter state, so a resume that lost it would drift."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _tag_directories(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.iterdir() if p.is_dir())


def _save_and_resume(stage: int, root: Path) -> dict[str, Any]:
    full = AdamModel()
    checkpoints = accord.callbacks.ModelCheckpoint(
        dirpath=root, filename="{epoch}", save_top_k=-1, save_last=True
    )
    _trainer(DeepSpeedStrategy(stage=stage), max_epochs=3, callbacks=[checkpoints]).fit(
        full, loader(batch_size=16)
    )
    resumed = AdamModel()
    _trainer(DeepSpeedStrategy(stage=stage), max_epochs=3).fit(
        resumed, loader(batch_size=16), ckpt_path=root / "epoch=0.ckpt"
    )
    evaluated = LinearModel()
    _trainer(DeepSpeedStrategy(stage=stage)).validate(
        evaluated, loader(batch_size=16), ckpt_path=root / "epoch=2.ckpt"
    )
    return {
        "full": flat_weights(full),
        "resumed": flat_weights(resumed),
        "evaluated": flat_weights(evaluated),
        "files": sorted(p.name for p in root.iterdir()),
        "tags": _tag_directories(root / "last.ckpt"),
        "latest": (root / "last.ckpt" / "latest").read_text(),
    }


class RecordingCollective(DeepSpeedCollective):
    """A user's collective that notes the barriers and object broadcasts sent through it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def barrier(self, name: str | None = None) -> None:
        self.calls.append(("barrier", str(name)))
        super().barrier(name)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        result = super().broadcast_object(obj, src)
        self.calls.append(("broadcast_object", repr(result)))
        return result


def _save_through_a_custom_collective(root: Path) -> list[tuple[str, str]]:
    """What a 2-epoch fit that saves ``last.ckpt`` twice sent through a user's collective."""
    collective = RecordingCollective()
    last = accord.callbacks.ModelCheckpoint(dirpath=root, save_top_k=0, save_last=True)
    strategy = DeepSpeedStrategy(stage=2, collective=collective)
    _trainer(strategy, max_epochs=2, callbacks=[last]).fit(AdamModel(), loader(batch_size=16))
    assert strategy.base_collective is collective
    return collective.calls


def _checkpoints(rank: int, world_size: int, root: Path) -> dict[int | str, Any]:
    runs: dict[int | str, Any] = {
        stage: _save_and_resume(stage, root / f"stage{stage}") for stage in (2, 3)
    }
    runs["custom"] = _save_through_a_custom_collective(root / "custom")
    return runs


@pytest.fixture(scope="module")
def checkpoint_runs(
    deepspeed: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[int | str, Any]]]:
    """Save, resume and evaluate at ZeRO stages 2 and 3, and save through a user's
    collective, in one pair of processes."""
    root = tmp_path_factory.mktemp("deepspeed_checkpoints")
    return root, run_distributed(_checkpoints, 2, root, timeout=TIMEOUT)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_and_resume_reach_the_uninterrupted_weights(
    stage: int, checkpoint_runs: tuple[Path, list[dict[int | str, Any]]]
) -> None:
    root, ranks = checkpoint_runs
    results = [result[stage] for result in ranks]
    for result in results:
        assert result["files"] == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
        # last.ckpt was written three times: tags 0, 1, 0, and each save removed the other.
        assert result["latest"] == "checkpoint-0"
        assert result["tags"] == ["checkpoint-0"]
        torch.testing.assert_close(result["resumed"], result["full"], rtol=0, atol=1e-6)
        # validate(ckpt_path=...) without an optimizer consolidates the shards.
        torch.testing.assert_close(result["evaluated"], result["full"], rtol=0, atol=1e-6)
        torch.testing.assert_close(result["full"], results[0]["full"], rtol=0, atol=0)
    directory = root / f"stage{stage}" / "epoch=2.ckpt"
    assert directory.is_dir()  # a directory of shards, one per rank
    out = consolidate_deepspeed_checkpoint(directory, root / f"stage{stage}.pt")
    plain = LinearModel()
    plain.load_state_dict(torch.load(out, weights_only=True))
    torch.testing.assert_close(flat_weights(plain), results[0]["full"], rtol=0, atol=1e-6)


def test_a_save_sends_its_tag_and_barriers_through_the_collective(
    checkpoint_runs: tuple[Path, list[dict[int | str, Any]]],
) -> None:
    def save(previous: str | None, tag: str) -> list[tuple[str, str]]:
        return [
            ("broadcast_object", repr((previous, tag))),
            ("barrier", "deepspeed_save_checkpoint_written"),
            ("barrier", "save_checkpoint"),
        ]

    expected = [*save(None, "checkpoint-0"), *save("checkpoint-0", "checkpoint-1")]
    _, ranks = checkpoint_runs
    for result in ranks:
        calls = [tuple(call) for call in result["custom"]]
        # Every save step, in order; other traffic (metrics, callbacks) may come between.
        assert [call for call in calls if call in expected] == expected


def _fit_with_last(root: Path, max_epochs: int, ckpt_path: Path | None) -> dict[str, Any]:
    model = AdamModel()
    last = accord.callbacks.ModelCheckpoint(dirpath=root, save_top_k=0, save_last=True)
    _trainer(DeepSpeedStrategy(stage=2), max_epochs=max_epochs, callbacks=[last]).fit(
        model, loader(batch_size=16), ckpt_path=ckpt_path
    )
    evaluated = LinearModel()
    _trainer(DeepSpeedStrategy(stage=2)).validate(
        evaluated, loader(batch_size=16), ckpt_path=root / "last.ckpt"
    )
    return {"weights": flat_weights(model), "evaluated": flat_weights(evaluated)}


def _first_fit(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    return _fit_with_last(root, 2, None)


def _resume_past_a_torn_save(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    restored = _fit_with_last(root, 2, root / "last.ckpt")  # the fit is done: loads only
    continued = _fit_with_last(root, 3, root / "last.ckpt")
    return {"restored": restored, "continued": continued}


def test_a_save_that_did_not_finish_leaves_the_previous_checkpoint(
    deepspeed: Any, tmp_path: Path
) -> None:
    [before, _] = run_distributed(_first_fit, 2, tmp_path, timeout=TIMEOUT)
    last = tmp_path / "last.ckpt"
    assert (last / "latest").read_text() == "checkpoint-1"  # saved twice: tags 0, 1
    # What a crash in the middle of the third save leaves: the other tag, half written.
    torn = last / "checkpoint-0"
    torn.mkdir()
    for source in sorted((last / "checkpoint-1").iterdir()):
        data = source.read_bytes()
        (torn / source.name).write_bytes(data[: len(data) // 2])
    for result in run_distributed(_resume_past_a_torn_save, 2, tmp_path, timeout=TIMEOUT):
        restored, continued = result["restored"], result["continued"]
        torch.testing.assert_close(restored["weights"], before["weights"], rtol=0, atol=1e-6)
        torch.testing.assert_close(restored["evaluated"], before["weights"], rtol=0, atol=1e-6)
        assert not torch.equal(continued["weights"], before["weights"])
        torch.testing.assert_close(continued["evaluated"], continued["weights"], rtol=0, atol=1e-6)
    # Later saves replaced the torn tag; only the one that `latest` names is left.
    assert _tag_directories(last) == [(last / "latest").read_text()]


def test_a_first_save_that_did_not_finish_is_not_read(deepspeed: Any, tmp_path: Path) -> None:
    torn = tmp_path / "last.ckpt"
    (torn / "checkpoint-0").mkdir(parents=True)  # shards under way, `latest` not yet written
    with pytest.raises(CheckpointError, match=r"no 'latest' file .*Pass tag="):
        consolidate_deepspeed_checkpoint(torn, tmp_path / "weights.pt")
    assert not (tmp_path / "weights.pt").exists()


class KilledMidSave(DeepSpeedCollective):
    """Global rank 0 SIGKILLs itself in save number ``save``, once its own shards are
    written: the other rank may still be writing, and nothing is committed."""

    def __init__(self, save: int) -> None:
        super().__init__()
        self.save = save
        self.saves = 0

    def barrier(self, name: str | None = None) -> None:
        if name == "deepspeed_save_checkpoint_written":
            self.saves += 1
            if self.saves == self.save and self.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        super().barrier(name)


def _fit_saving_every_epoch(root: Path, collective: DeepSpeedCollective | None, **fit: Any) -> Any:
    model = AdamModel()
    checkpoints = accord.callbacks.ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    strategy = DeepSpeedStrategy(stage=2, collective=collective)
    _trainer(strategy, max_epochs=3, callbacks=[checkpoints]).fit(
        model, loader(batch_size=16), **fit
    )
    return model


def _killed_in_the_second_save(rank: int, world_size: int, root: Path) -> None:
    _fit_saving_every_epoch(root, KilledMidSave(save=2))


def _resume_from_last(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    resumed = _fit_saving_every_epoch(root, None, ckpt_path="last")
    full = _fit_saving_every_epoch(root / "uninterrupted", None)
    return {
        "resumed": flat_weights(resumed),
        "resumed_steps": len(resumed.losses),
        "full": flat_weights(full),
        "full_steps": len(full.losses),
    }


def test_a_killed_save_leaves_nothing_under_its_name(deepspeed: Any, tmp_path: Path) -> None:
    with pytest.raises(RankFailureError):  # rank 0 was killed, rank 1 lost its peer
        run_distributed(_killed_in_the_second_save, 2, tmp_path, timeout=TIMEOUT)
    # The shards of epoch=1.ckpt are under a staging name that ckpt_path="last" passes over.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".epoch=1.ckpt.tmp", "epoch=0.ckpt"]
    for result in run_distributed(_resume_from_last, 2, tmp_path, timeout=TIMEOUT):
        assert result["resumed_steps"] * 3 == result["full_steps"] * 2  # from epoch=0.ckpt
        torch.testing.assert_close(result["resumed"], result["full"], rtol=0, atol=1e-6)
    # The next save removed what the killed one left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=0.ckpt",
        "epoch=1.ckpt",
        "epoch=2.ckpt",
        "uninterrupted",
    ]


def test_a_save_removes_only_what_killed_saves_left(tmp_path: Path) -> None:
    from accord.engines.deepspeed.checkpoint_staging import remove_leftovers

    killed = tmp_path / ".epoch=3.ckpt.tmp"  # shards written, `latest` not yet
    (killed / "checkpoint-0").mkdir(parents=True)
    (killed / "checkpoint-0" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (killed / "zero_to_fp32.py").write_text("")
    (tmp_path / ".epoch=4.ckpt.tmp").mkdir()  # killed before any shard
    kept = {".notes.tmp": "notes.txt", ".sharded.ckpt.tmp": ".metadata", "epoch=2.ckpt": "latest"}
    for folder, name in kept.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("not a DeepSpeed save's leftover")
    remove_leftovers(tmp_path, ("checkpoint-0", "checkpoint-1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


# ------------------------------------------------ agreement across ranks (one job)
def _helpers() -> dict[str, Any]:
    answers: dict[str, Any] = {}
    rank = int(os.environ["RANK"])
    for key, strategy in (
        ("ddp", DDPStrategy(process_group_backend="gloo")),
        ("deepspeed", DeepSpeedStrategy()),
    ):
        accord.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
        strategy.setup_environment()
        try:
            answers[key] = {
                "collective": type(strategy.base_collective).__name__,
                "gather": strategy.all_gather(torch.arange(rank + 1)).tolist(),
                "gather_rows": strategy.all_gather(torch.full((2 - rank, 3), rank)).tolist(),
                "mean": float(strategy.reduce(torch.tensor(float(rank)))),
                "object": strategy.broadcast({"from": rank}, src=1),
                "tensor": strategy.broadcast(torch.tensor([rank, 10 * rank]), src=1).tolist(),
                "any": strategy.reduce_boolean_decision(rank == 1, all=False),
                "all": strategy.reduce_boolean_decision(rank == 1, all=True),
                "every": strategy.reduce_boolean_decision(True, all=True),
            }
        finally:
            strategy.teardown()
    return answers


class PlateauOnRankOne(LinearModel):
    """Rank 1's validation metric stops improving after epoch 1; rank 0's keeps improving."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        value = 1.0 / (epoch + 1) if self.global_rank == 0 or epoch < 1 else 0.5
        self.log("score", torch.tensor(value))  # not synced: each rank judges its own


def _early_stop() -> int:
    trainer = _trainer(
        "deepspeed",
        max_epochs=20,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[accord.callbacks.EarlyStopping("score", patience=2)],
    )
    trainer.fit(PlateauOnRankOne(), loader(batch_size=16), loader(batch_size=16))
    return trainer.current_epoch


def _agreement(rank: int, world_size: int) -> dict[str, Any]:
    return {"helpers": _helpers(), "stopped_at": _early_stop()}


@pytest.fixture(scope="module")
def agreement(deepspeed: Any) -> list[dict[str, Any]]:
    """The communication helpers under DDP and DeepSpeed, then an early-stopped fit."""
    return run_distributed(_agreement, 2, timeout=TIMEOUT)


def test_helpers_give_the_answers_ddp_gives(agreement: list[dict[str, Any]]) -> None:
    for result in (rank["helpers"] for rank in agreement):
        assert result["deepspeed"].pop("collective") == "DeepSpeedCollective"
        assert result["ddp"].pop("collective") == "TorchCollective"
        assert result["deepspeed"] == result["ddp"]
        assert result["ddp"]["gather"] == [0, 0, 1]
        assert result["ddp"]["gather_rows"] == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]
        assert result["ddp"]["object"] == {"from": 1}
        assert (result["ddp"]["any"], result["ddp"]["all"], result["ddp"]["every"]) == (
            True,
            False,
            True,
        )


def test_early_stopping_on_one_rank_stops_every_rank_together(
    agreement: list[dict[str, Any]],
) -> None:
    # Rank 1 asks to stop after epoch 3 (no improvement at epochs 2 and 3); rank 0 follows.
    assert [rank["stopped_at"] for rank in agreement] == [4, 4]
