"""Lightning's callbacks and loggers by name: their constructors, the new callbacks, and
the names accord refuses.

Where Lightning 2.6.6 is installed (``make .venv-bench/.installed``) the constructors'
parameters and the packages' public names are compared with Lightning's own.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accord
import accord.callbacks
import accord.loggers
from accord.callbacks import (
    BasePredictionWriter,
    Callback,
    Checkpoint,
    EarlyStopping,
    EarlyStoppingReason,
    LambdaCallback,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    Timer,
    TQDMProgressBar,
    summarize,
)
from accord.errors import ConfigurationError, RankFailureError
from accord.loggers import CSVLogger
from accord.testing import run_distributed
from tests.helpers.models import FailingModel, LinearModel, loader, regression_data
from tests.helpers.processes import ROOT

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"


def _trainer(root: Path, callbacks: list[Callback], **kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "logger": False,
        **kwargs,
    }
    return accord.Trainer(callbacks=callbacks, **settings)


def _ddp(**kwargs: Any) -> accord.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "strategy": "ddp",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return accord.Trainer(**settings)


class Scored(LinearModel):
    """Logs ``score`` = the epoch number at each epoch's end."""

    def on_train_epoch_end(self) -> None:
        self.log("score", float(self.current_epoch))


# ---------------------------------------------------------------- EarlyStopping
def test_early_stopping_positional_arguments_are_lightnings(tmp_path: Path) -> None:
    stop = EarlyStopping("val_loss", 0.5, 7, True, "max", False, False, 1.0, 9.0, True, True)
    assert (stop.monitor, stop.min_delta, stop.patience, stop.verbose) == ("val_loss", 0.5, 7, True)
    assert (stop.mode, stop.strict, stop.check_finite) == ("max", False, False)
    assert (stop.stopping_threshold, stop.divergence_threshold) == (1.0, 9.0)
    assert stop.check_on_train_epoch_end is True and stop.log_rank_zero_only is True

    # The fifth positional argument is the mode: "max" on a score that only grows never
    # waits, where "min" would stop after one check without improvement.
    growing = EarlyStopping("score", 0.0, 1, False, "max")
    trainer = _trainer(tmp_path, [growing], max_epochs=4, limit_train_batches=2)
    trainer.fit(Scored(), loader(16))
    assert growing.stopped_epoch == 0 and trainer.current_epoch == 4
    shrinking = EarlyStopping("score", 0.0, 1, False, "min")
    trainer = _trainer(tmp_path, [shrinking], max_epochs=4, limit_train_batches=2)
    trainer.fit(Scored(), loader(16))
    assert shrinking.stopped_epoch == 1
    assert shrinking.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED


def test_divergence_and_stopping_thresholds_stop_as_in_lightning(tmp_path: Path) -> None:
    # score = 0, 1, 2, 3, ...: worse than 2.5 (mode "min") at epoch 3.
    diverged = EarlyStopping("score", patience=100, divergence_threshold=2.5)
    _trainer(tmp_path, [diverged], max_epochs=10, limit_train_batches=2).fit(Scored(), loader(16))
    assert diverged.stopped_epoch == 3
    assert diverged.stopping_reason == EarlyStoppingReason.DIVERGENCE_THRESHOLD
    assert diverged.stopping_reason_message is not None
    assert "divergence_threshold 2.5" in diverged.stopping_reason_message

    # Lightning's thresholds are strict: reaching 2 is not better than 2; 3 is.
    reached = EarlyStopping("score", patience=100, mode="max", stopping_threshold=2.0)
    _trainer(tmp_path, [reached], max_epochs=10, limit_train_batches=2).fit(Scored(), loader(16))
    assert reached.stopped_epoch == 3
    assert reached.stopping_reason == EarlyStoppingReason.STOPPING_THRESHOLD


def test_verbose_early_stopping_logs_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accord.callbacks.early_stopping")
    stop = EarlyStopping("score", patience=1, verbose=True)
    _trainer(tmp_path, [stop], max_epochs=5, limit_train_batches=2).fit(Scored(), loader(16))
    messages = [r.getMessage() for r in caplog.records if r.name == stop.__module__]
    assert messages == [
        "EarlyStopping: score improved to 0.",
        "EarlyStopping: score did not improve for 1 checks (best 0). The fit stops.",
    ]
    caplog.clear()
    quiet = EarlyStopping("score", patience=1)
    _trainer(tmp_path, [quiet], max_epochs=5, limit_train_batches=2).fit(Scored(), loader(16))
    assert not [r for r in caplog.records if r.name == quiet.__module__]


def _verbose_on_two_ranks(rank: int, world_size: int, rank_zero_only: bool) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("accord.callbacks.early_stopping")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    stop = EarlyStopping("score", patience=1, verbose=True, log_rank_zero_only=rank_zero_only)
    _ddp(max_epochs=3, limit_train_batches=2, callbacks=[stop]).fit(Scored(), loader(8))
    return records


def test_verbose_early_stopping_on_two_ranks_prefixes_the_rank() -> None:
    every = run_distributed(_verbose_on_two_ranks, 2, False, timeout=180)
    assert [m.split("]")[0] for m in every[0]] == ["[rank: 0", "[rank: 0"]
    assert [m.split("]")[0] for m in every[1]] == ["[rank: 1", "[rank: 1"]
    zero_only = run_distributed(_verbose_on_two_ranks, 2, True, timeout=180)
    assert len(zero_only[0]) == 2 and zero_only[1] == []


# ----------------------------------------------------------- LearningRateMonitor
class TwoGroups(LinearModel):
    """SGD with momentum and weight decay over two parameter groups, the second named."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(1, 1)

    def configure_optimizers(self) -> Any:
        groups: list[dict[str, Any]] = [
            {"params": self.layer.parameters()},
            {"params": self.head.parameters(), "name": "head", "weight_decay": 0.5},
        ]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)


def test_lr_monitor_logs_momentum_and_weight_decay_under_lightnings_keys(tmp_path: Path) -> None:
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(
        tmp_path, [monitor], logger=logger, log_every_n_steps=1, limit_train_batches=2
    )
    trainer.fit(TwoGroups(), loader(16))
    assert sorted(monitor.lrs) == ["lr-SGD/head", "lr-SGD/pg1"]
    assert monitor.last_momentum_values == {"lr-SGD/pg1-momentum": 0.9, "lr-SGD/head-momentum": 0.9}
    assert monitor.last_weight_decay_values == {
        "lr-SGD/pg1-weight_decay": 0.01,
        "lr-SGD/head-weight_decay": 0.5,
    }
    header = logger.metrics_file.read_text().splitlines()[0].split(",")
    assert {"lr-SGD/pg1-weight_decay", "lr-SGD/head-momentum"} <= set(header)
    # As in Lightning, the values are also callback metrics.
    assert float(trainer.callback_metrics["lr-SGD/head-weight_decay"]) == 0.5


LR_KEYS_SCRIPT = """\
{imports}
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(LightningModule):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.body(x)).squeeze(-1), y)

    def configure_optimizers(self):
        if self.config == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=0.1)
        groups = [{{"params": self.body.parameters()}}, {{"params": self.head.parameters()}}]
        if self.config == "named":
            groups[1]["name"] = "head"
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        config = {{"scheduler": scheduler, "interval": "step"}}
        if self.config == "named":
            config["name"] = "sched"
        return {{"optimizer": optimizer, "lr_scheduler": config}}


result = {{}}
for config in ("adam", "sgd", "named"):
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(sys.argv[1], name=config),
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=4)
    trainer.fit(Net(config), data)
    result[config] = [
        sorted(monitor.lrs),
        sorted(monitor.last_momentum_values),
        sorted(monitor.last_weight_decay_values),
    ]
print(json.dumps(result))
"""


def _lr_keys(python: Path | str, imports: str, out: Path, **env: str) -> Any:
    out.mkdir()
    script = out / "lr_keys.py"
    script.write_text(LR_KEYS_SCRIPT.format(imports=imports))
    done = subprocess.run(
        [str(python), str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lr_monitor_keys_are_lightnings(tmp_path: Path) -> None:
    if not BENCH_PYTHON.exists():
        pytest.skip("Lightning is not installed (make .venv-bench/.installed)")
    ours = _lr_keys(
        sys.executable,
        "from accord import Module as LightningModule, Trainer\n"
        "from accord.callbacks import LearningRateMonitor\n"
        "from accord.loggers import CSVLogger",
        tmp_path / "accord",
        PYTHONPATH=str(ROOT / "src"),
    )
    theirs = _lr_keys(
        BENCH_PYTHON,
        "from pytorch_lightning import LightningModule, Trainer\n"
        "from pytorch_lightning.callbacks import LearningRateMonitor\n"
        "from pytorch_lightning.loggers import CSVLogger",
        tmp_path / "lightning",
        PYTHONPATH="",
    )
    assert ours == theirs
    assert theirs["named"][2] == ["sched/head-weight_decay", "sched/pg1-weight_decay"]


# ------------------------------------------------------------------ ModelSummary
class Nested(LinearModel):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
        self.encoder[0].requires_grad_(False)


def test_model_summary_lists_layers_to_max_depth(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = Nested()
    assert [r.name for r in summarize(model)] == ["layer", "encoder"]
    assert [r.name for r in summarize(model, 2)] == ["layer", "encoder", "encoder.0", "encoder.1"]
    every = {r.name: r for r in summarize(model, -1)}
    assert list(every) == [
        "layer",
        "encoder",
        "encoder.0",
        "encoder.1",
        "encoder.1.0",
        "encoder.1.1",
    ]
    # A layer's row counts what its children hold.
    assert (every["encoder"].trainable, every["encoder"].frozen) == (18, 72)
    assert every["encoder.1.0"].params == 0 and every["encoder.1.0"].type == "ReLU"
    assert summarize(model, 0) == []
    with pytest.raises(ConfigurationError, match="max_depth=-2"):
        ModelSummary(max_depth=-2)
    with pytest.raises(ConfigurationError, match="RichModelSummary"):
        ModelSummary(header_style="bold")

    summary = ModelSummary(max_depth=2)
    with caplog.at_level(logging.INFO, logger="accord"):
        _trainer(tmp_path, [summary], max_epochs=1, limit_train_batches=1).fit(model, loader(16))
    out = caplog.text
    caplog.clear()
    assert summary.text in out and "encoder.1 " in out and "encoder.1.0" not in out
    assert f"{6:<10} Modules in train mode" in out

    silent = ModelSummary(max_depth=0)
    with caplog.at_level(logging.INFO, logger="accord"):
        _trainer(tmp_path, [silent], max_epochs=1, limit_train_batches=1).fit(Nested(), loader(16))
    assert silent.text == "" and "Trainable params" not in caplog.text


def test_a_model_summary_subclass_gets_the_summarize_kwargs(tmp_path: Path) -> None:
    seen: list[Any] = []

    class Styled(ModelSummary):
        @staticmethod
        def summarize(
            summary_data: list[tuple[str, list[str]]],
            total_parameters: int,
            trainable_parameters: int,
            model_size: float,
            total_training_modes: dict[str, int],
            total_flops: int,
            **summarize_kwargs: Any,
        ) -> None:
            seen.append((summary_data[1], total_parameters, summarize_kwargs))

    _trainer(tmp_path, [Styled(style="bold")], max_epochs=1, limit_train_batches=1).fit(
        LinearModel(), loader(16)
    )
    assert seen == [(("Name", ["layer"]), 9, {"style": "bold"})]


# ------------------------------------------------------------------ progress bars
def test_tqdm_progress_bar_is_the_default_and_takes_lightnings_arguments(tmp_path: Path) -> None:
    trainer = accord.Trainer(accelerator="cpu", default_root_dir=tmp_path, logger=False)
    assert type(trainer.progress_bar_callback) is TQDMProgressBar
    made: list[str] = []

    class Described(TQDMProgressBar):
        # Lightning's way to change a bar: override its init_<stage>_tqdm method.
        def init_validation_tqdm(self) -> Any:
            made.append(self.trainer.stage)
            return super().init_validation_tqdm()

    bar = Described(5, 1, True)
    assert (bar.refresh_rate, bar.process_position, bar.is_enabled) == (5, 1, True)
    assert TQDMProgressBar(refresh_rate=0).is_disabled
    trainer = _trainer(tmp_path, [bar], max_epochs=2, limit_train_batches=3, limit_val_batches=2)
    assert trainer.progress_bar_callback is bar
    trainer.fit(LinearModel(), loader(16), loader(16))
    trainer.validate(LinearModel(), loader(16))
    assert made == ["fit", "fit", "validate"]


def test_a_progress_bar_of_ones_own_replaces_the_default(tmp_path: Path) -> None:
    class Dots(ProgressBar):
        def __init__(self) -> None:
            super().__init__()
            self.dots = 0
            self.enabled = True

        def disable(self) -> None:
            self.enabled = False

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.dots += 1

    dots = Dots()
    trainer = _trainer(tmp_path, [dots], enable_progress_bar=True, limit_train_batches=2)
    assert [cb for cb in trainer.callbacks if isinstance(cb, ProgressBar)] == [dots]
    trainer.fit(LinearModel(), loader(16))
    assert dots.dots == 4 and dots.trainer is trainer
    assert dots.total_train_batches == 2

    class Unfinished(ProgressBar):
        pass

    # Lightning's base class asks a subclass for disable(); so does accord's.
    with pytest.raises(NotImplementedError, match="TQDMProgressBar"):
        Unfinished().disable()


# ------------------------------------------------------------------ LambdaCallback
def test_lambda_callback_hooks_fire_with_the_hooks_arguments(tmp_path: Path) -> None:
    calls: list[Any] = []
    hooks = LambdaCallback(
        on_fit_start=lambda trainer, module: calls.append(("fit_start", type(module).__name__)),
        on_train_batch_end=lambda trainer, module, outputs, batch, idx: calls.append(
            ("batch", idx)
        ),
        on_validation_epoch_end=lambda trainer, module: calls.append(("val", trainer.stage)),
        teardown=lambda trainer, module, stage: calls.append(("teardown", stage)),
    )
    _trainer(tmp_path, [hooks], max_epochs=1, limit_train_batches=2, limit_val_batches=1).fit(
        LinearModel(), loader(16), loader(16)
    )
    assert calls == [
        ("fit_start", "LinearModel"),
        ("val", "fit"),  # the sanity check
        ("batch", 0),
        ("batch", 1),
        ("val", "fit"),
        ("teardown", "fit"),
    ]
    with pytest.raises(ConfigurationError, match=r"on_fit_start=\.\.\.\) must be a function"):
        LambdaCallback(on_fit_start=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LambdaCallback(on_train_epoch_ends=print)  # type: ignore[call-arg]


# ------------------------------------------------------------- BasePredictionWriter
class FileWriter(BasePredictionWriter):
    """Writes each batch and the whole epoch to ``out``, named by rank."""

    def __init__(self, out: Path, write_interval: str) -> None:
        super().__init__(write_interval)
        self.out = out

    def write_on_batch_end(
        self,
        trainer: accord.Trainer,
        module: accord.Module,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        path = self.out / f"batch-{trainer.global_rank}-{batch_idx}.pt"
        torch.save({"prediction": prediction, "indices": list(batch_indices or [])}, path)

    def write_on_epoch_end(
        self,
        trainer: accord.Trainer,
        module: accord.Module,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        path = self.out / f"epoch-{trainer.global_rank}.pt"
        torch.save({"predictions": list(predictions), "indices": batch_indices}, path)


def _expected(indices: list[int]) -> torch.Tensor:
    with torch.no_grad():
        predicted: torch.Tensor = LinearModel()(regression_data(18)[indices][0])
    return predicted


def test_prediction_writer_writes_per_batch_and_per_epoch(tmp_path: Path) -> None:
    both = FileWriter(tmp_path, "batch_and_epoch")
    trainer = _trainer(tmp_path, [both])
    returned = trainer.predict(LinearModel(), loader(8, samples=18))
    assert returned is not None and len(returned) == 3
    batches = [torch.load(tmp_path / f"batch-0-{i}.pt") for i in range(3)]
    assert [b["indices"] for b in batches] == [list(range(8)), list(range(8, 16)), [16, 17]]
    for saved in batches:
        torch.testing.assert_close(saved["prediction"], _expected(saved["indices"]))
    epoch = torch.load(tmp_path / "epoch-0.pt")
    assert epoch["indices"] == [[b["indices"] for b in batches]]
    torch.testing.assert_close(torch.cat(epoch["predictions"]), _expected(list(range(18))))

    # "batch" never calls write_on_epoch_end, "epoch" never write_on_batch_end.
    for interval, files in (("batch", {"batch-0-0.pt"}), ("epoch", {"epoch-0.pt"})):
        out = tmp_path / interval
        out.mkdir()
        _trainer(out, [FileWriter(out, interval)]).predict(LinearModel(), loader(16, samples=16))
        assert {p.name for p in out.iterdir()} == files
    with pytest.raises(ConfigurationError, match="write_interval='step'"):
        BasePredictionWriter("step")


def test_prediction_writer_without_known_indices_warns(tmp_path: Path) -> None:
    writer = FileWriter(tmp_path, "batch")
    with pytest.warns(UserWarning, match="batch_indices are empty"):
        _trainer(tmp_path, [writer]).predict(LinearModel(), loader(8, samples=16, shuffle=True))
    assert torch.load(tmp_path / "batch-0-1.pt")["indices"] == []


def _predict_on_two_ranks(rank: int, world_size: int, out: str) -> int:
    trainer = _ddp(callbacks=[FileWriter(Path(out), "batch_and_epoch")])
    predictions = trainer.predict(LinearModel(), loader(4, samples=18))
    return len(predictions or [])


def test_prediction_writer_on_two_ranks_writes_each_ranks_share(tmp_path: Path) -> None:
    assert run_distributed(_predict_on_two_ranks, 2, str(tmp_path), timeout=180) == [3, 3]
    seen: list[int] = []
    for rank in (0, 1):
        epoch = torch.load(tmp_path / f"epoch-{rank}.pt")
        indices = [i for batch in epoch["indices"][0] for i in batch]
        assert indices == list(range(rank, 18, 2))
        torch.testing.assert_close(torch.cat(epoch["predictions"]), _expected(indices))
        last = torch.load(tmp_path / f"batch-{rank}-2.pt")
        assert last["indices"] == [16 + rank]
        seen += indices
    assert sorted(seen) == list(range(18))


# ------------------------------------------------------------ OnExceptionCheckpoint
def test_on_exception_checkpoint_saves_when_the_fit_fails(tmp_path: Path) -> None:
    saver = OnExceptionCheckpoint(tmp_path / "saved")
    assert isinstance(saver, Checkpoint) and issubclass(ModelCheckpoint, Checkpoint)
    trainer = _trainer(tmp_path, [saver], enable_checkpointing=True)
    # A Checkpoint among the callbacks: no default ModelCheckpoint, as in Lightning.
    assert not any(isinstance(cb, ModelCheckpoint) for cb in trainer.callbacks)
    with pytest.raises(RuntimeError, match="fails on purpose"):
        trainer.fit(FailingModel(fail_rank=0), loader(16))
    path = Path(saver.ckpt_path)
    assert path == tmp_path / "saved" / "on_exception.ckpt"
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 2
    resumed = _trainer(tmp_path, [OnExceptionCheckpoint(tmp_path / "saved")], max_epochs=1)
    resumed.fit(LinearModel(), loader(16), ckpt_path=path)
    assert resumed.global_step == 16
    # A run that ends well removes the file, as Lightning's teardown does.
    assert not path.exists()
    with pytest.raises(ConfigurationError, match="needs a file name"):
        OnExceptionCheckpoint(tmp_path, filename="")


def test_on_exception_checkpoint_never_asks_other_ranks_for_their_shards(tmp_path: Path) -> None:
    from accord.callbacks.on_exception_checkpoint import _holds_whole_state
    from accord.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, XLAStrategy

    # With several ranks these save each rank's own state; the sharding ones save nothing.
    assert _holds_whole_state(DDPStrategy)
    assert not any(map(_holds_whole_state, (FSDPStrategy, DeepSpeedStrategy, XLAStrategy)))

    class Broken(LinearModel):
        def setup(self, stage: str) -> None:
            raise RuntimeError("setup fails on purpose")

    saver = OnExceptionCheckpoint(tmp_path)
    with (
        pytest.raises(RuntimeError, match="setup fails"),
        pytest.warns(RuntimeWarning, match="before its model was set up"),
    ):
        _trainer(tmp_path, [saver]).fit(Broken(), loader(16))
    assert not Path(saver.ckpt_path).exists()


def _fail_on_rank_one(rank: int, world_size: int, out: str) -> None:
    trainer = _ddp(max_epochs=1, callbacks=[OnExceptionCheckpoint(out)])
    trainer.fit(FailingModel(fail_rank=1), loader(8))


def test_on_exception_checkpoint_on_two_ranks_saves_without_waiting(tmp_path: Path) -> None:
    # Rank 1 raises in its training_step while rank 0 goes on to the gradients' all-reduce:
    # rank 1 saves its own state without any collective, and nothing waits forever.
    with pytest.raises(RankFailureError, match="rank 1 fails on purpose"):
        run_distributed(_fail_on_rank_one, 2, str(tmp_path), timeout=180)
    state = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert state["global_step"] == 2 and state["world_size"] == 2


# ----------------------------------------------------------------- refused names
@pytest.mark.parametrize(
    ("package", "name"),
    [
        *((accord.callbacks, name) for name in accord.callbacks.NOT_PROVIDED),
        *((accord.loggers, name) for name in accord.loggers.NOT_PROVIDED),
    ],
)
def test_a_lightning_name_accord_does_not_provide_says_why(package: Any, name: str) -> None:
    why, instead = package.NOT_PROVIDED[name]
    with pytest.raises(ImportError) as raised:
        exec(f"from {package.__name__} import {name}", {})
    message = str(raised.value)
    assert message.startswith(f"{name} is a Lightning ")
    assert why in message and instead in message
    assert name not in package.__all__
    with pytest.raises(AttributeError):
        _ = package.NoSuchName


DOC = ROOT / "docs" / "from-lightning.md"
START, END = "<!-- lightning-refused:start -->", "<!-- lightning-refused:end -->"


def render_refused() -> str:
    """The table of docs/from-lightning.md made from the two `NOT_PROVIDED` tables."""
    rows = ["| Lightning name | why accord does not provide it | instead |", "|---|---|---|"]
    for package in (accord.callbacks, accord.loggers):
        for name, (why, instead) in sorted(package.NOT_PROVIDED.items()):
            # Escaped, so that names such as requires_grad_ do not start emphasis.
            why, instead = why.replace("_", "\\_"), instead.replace("_", "\\_")
            rows.append(f"| `{package.__name__}.{name}` | {why}. | {instead}. |")
    return "\n".join(rows)


def test_the_docs_list_the_refused_names() -> None:
    text = DOC.read_text()
    shown = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert shown == render_refused(), (
        "docs/from-lightning.md's table of refused callbacks and loggers is out of date; run "
        "`python tests/trainer/test_lightning_callbacks.py --write`"
    )


# ----------------------------------------------------- Lightning's own signatures
DUMP = """\
import inspect, json
from enum import Enum
import pytorch_lightning.callbacks as callbacks
import pytorch_lightning.loggers as loggers

def default(value):
    if value is inspect.Parameter.empty:
        return "<required>"
    if isinstance(value, Enum):
        value = value.value
    return value if isinstance(value, (type(None), bool, int, float, str)) else "<object>"

def parameters(cls):
    found = inspect.signature(cls).parameters.values()
    return [[p.name, p.kind.name, default(p.default)] for p in found]

print(json.dumps({
    package.__name__.rsplit(".", 1)[1]: {
        name: parameters(getattr(package, name)) for name in package.__all__
    }
    for package in (callbacks, loggers)
}))
"""

# Defaults accord chose to differ from Lightning's, with the reason (the docs say so too).
DIFFERENT_DEFAULTS = {
    ("CSVLogger", "save_dir"): "accord writes under the working directory by default",
    ("CSVLogger", "name"): "accord's logs go to logs/, Lightning's to lightning_logs/",
    ("TensorBoardLogger", "save_dir"): "as CSVLogger",
    ("TensorBoardLogger", "name"): "as CSVLogger",
}


# Base classes whose constructor takes arguments where Lightning's takes none.
EXTENDED = {
    "Logger": "it holds the save_dir, name and version its file-writing subclasses share",
}


def _parameters(cls: type) -> list[list[Any]]:
    result = []
    found = inspect.signature(cls).parameters.values()
    for p in found:
        value = p.default
        if value is inspect.Parameter.empty:
            value = "<required>"
        elif isinstance(value, Enum):
            value = value.value
        elif not isinstance(value, (type(None), bool, int, float, str)):
            value = "<object>"
        result.append([p.name, p.kind.name, value])
    return result


def test_names_and_constructors_are_lightnings() -> None:
    if not BENCH_PYTHON.exists():
        pytest.skip("Lightning is not installed (make .venv-bench/.installed)")
    done = subprocess.run(
        [str(BENCH_PYTHON), "-c", DUMP],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lightning = json.loads(done.stdout.strip().splitlines()[-1])
    compared = 0
    for package in (accord.callbacks, accord.loggers):
        theirs = lightning[package.__name__.rsplit(".", 1)[1]]
        refused = set(package.NOT_PROVIDED)
        silent = sorted(set(theirs) - set(package.__all__) - refused)
        assert not silent, f"Lightning names neither provided nor refused: {silent}"
        # NeptuneLogger is only in pytorch_lightning.loggers.neptune (it raises there).
        assert refused - set(theirs) <= {"NeptuneLogger"}
        for name in sorted(set(theirs) & set(package.__all__)):
            ours = _parameters(getattr(package, name))
            if name in EXTENDED:
                # Only optional arguments where Lightning's takes none: its calls work.
                assert theirs[name] == [] and all(p[2] != "<required>" for p in ours), name
                compared += 1
                continue
            assert [p[:2] for p in ours] == [p[:2] for p in theirs[name]], name
            for (parameter, _, mine), (_, _, their) in zip(ours, theirs[name], strict=True):
                if (name, parameter) not in DIFFERENT_DEFAULTS:
                    assert mine == their, f"{name}({parameter}=...): {mine!r} != {their!r}"
            compared += 1
    assert compared == 16


def test_timer_measures_lightnings_stages() -> None:
    timer = Timer()
    assert timer.time_elapsed("validate") == 0.0 and timer.start_time("test") is None
    with pytest.raises(ConfigurationError, match="stage='fit'"):
        timer.time_elapsed("fit")
    assert OnExceptionCheckpoint.FILE_EXTENSION == ModelCheckpoint.FILE_EXTENSION == ".ckpt"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = DOC.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{START}\n{render_refused()}\n{END}{after}")
