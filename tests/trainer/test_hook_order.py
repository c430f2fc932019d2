"""Every hook runs at Lightning's point, in Lightning's order, on every strategy.

One script, run with accord's imports and (where Lightning is installed) Lightning's,
records every module and callback hook call of a fit (sanity check, two epochs of four
batches accumulated in pairs, clipping, a step LR scheduler, a checkpoint each epoch),
then a test from the last checkpoint and a predict. Lightning 2.6.6's sequence on one
device is kept in ``data/lightning_hook_order.json`` (checked against Lightning itself when
it is installed). accord's sequence must equal it on one device and on every rank of
``ddp``, ``fsdp`` and ``deepspeed_stage_2`` at two ranks (each rank sees as many batches as
the single device does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import ROOT

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
SNAPSHOT = Path(__file__).with_name("data") / "lightning_hook_order.json"
DEEPSPEED_REFUSED = ("backward", "optimizer_zero_grad", "configure_gradient_clipping")

ACCORD_IMPORTS = """\
from accord import Module as LightningModule
from accord import Trainer
from accord.callbacks import Callback, ModelCheckpoint
"""
LIGHTNING_IMPORTS = """\
import atexit
import time

atexit.register(time.sleep, 0.1)
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
"""

SCRIPT = """\
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

{imports}

calls = []
MODULE_HOOKS = [
    name for name in dir(LightningModule)
    if name.startswith("on_") and name not in ("on_gpu",)
] + [
    "setup", "teardown", "prepare_data", "configure_model", "configure_callbacks",
    "configure_optimizers", "training_step", "validation_step", "test_step", "predict_step",
    "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step",
    "configure_gradient_clipping", "backward", "transfer_batch_to_device",
]


class Net(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch[0]).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {{"optimizer": optimizer, "lr_scheduler": {{"scheduler": scheduler, "interval": "step"}}}}


def record(cls, names, kind, skip_args):
    for name in names:
        original = getattr(cls, name)

        def wrapper(self, *args, __name=name, __original=original, **kwargs):
            calls.append(f"{{kind}} {{__name}}")
            return __original(self, *args, **kwargs)

        setattr(cls, name, wrapper)


class Recorder(Callback):
    pass


# DeepSpeed's engine runs backward, zeroing and clipping itself: accord refuses a module
# that overrides those hooks there, so they are not recorded (nor called) on it.
REFUSED = ("backward", "optimizer_zero_grad", "configure_gradient_clipping")
deepspeed = sys.argv[2].startswith("deepspeed")
record(Net, [n for n in MODULE_HOOKS if not (deepspeed and n in REFUSED)], "M", 0)
record(
    Recorder,
    [n for n in vars(Callback) if n.startswith("on_") or n in ("setup", "teardown")],
    "C",
    2,
)


def main(out: Path, strategy: str, devices: int) -> None:
    def loader(n):
        data = TensorDataset(torch.randn(n * devices, 4, generator=torch.Generator().manual_seed(n)))
        return DataLoader(data, batch_size=2)

    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        num_sanity_val_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(), ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)],
    )
    model = Net()
    trainer.fit(model, loader(8), loader(4))
    # A new module for test and predict: FSDP refuses to run again the module it sharded.
    calls.append("-- test")
    last = str(out / "checkpoints" / "last.ckpt")
    trainer.test(Net(), loader(4), ckpt_path=last, verbose=False)
    calls.append("-- predict")
    trainer.predict(Net(), loader(4))
    rank = trainer.global_rank
    (out / f"calls-{{rank}}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
"""


def run_script(python: Path | str, imports: str, out: Path, strategy: str, devices: int) -> None:
    script = out / "hooks.py"
    script.write_text(SCRIPT.format(imports=imports))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [str(python), str(script), str(out), strategy, str(devices)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{strategy} x{devices}:\n{result.stdout}\n{result.stderr}"


def sequence(out: Path, rank: int = 0) -> list[str]:
    return list(json.loads((out / f"calls-{rank}.json").read_text()))


def test_lightnings_sequence_is_the_snapshot(tmp_path: Path) -> None:
    if not BENCH_PYTHON.exists():
        pytest.skip("Lightning is not installed (make .venv-bench/.installed)")
    run_script(BENCH_PYTHON, LIGHTNING_IMPORTS, tmp_path, "auto", 1)
    assert sequence(tmp_path) == json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("single_device", 1), ("ddp", 2), ("fsdp", 2), ("deepspeed_stage_2", 2)],
)
def test_hooks_run_in_lightnings_order(tmp_path: Path, strategy: str, devices: int) -> None:
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    run_script(sys.executable, ACCORD_IMPORTS, tmp_path, strategy, devices)
    expected = json.loads(SNAPSHOT.read_text())
    for rank in range(devices):
        # prepare_data runs on local rank zero only, as in Lightning.
        left_out = {"M prepare_data"} if rank else set()
        if strategy.startswith("deepspeed"):
            left_out |= {f"M {name}" for name in DEEPSPEED_REFUSED}
        mine = [c for c in expected if c not in left_out]
        assert sequence(tmp_path, rank) == mine, f"rank {rank} of {strategy}"
