"""A checkpoint write killed half-way leaves the previous checkpoint intact."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from accord.checkpoint_io import load_checkpoint_file, save_checkpoint_file

WRITER = """
import sys, torch
from accord.checkpoint_io import save_checkpoint_file
path = sys.argv[1]
save_checkpoint_file({"version": 0, "weights": torch.zeros(4)}, path)
print("ready", flush=True)
version = 1
while True:  # large writes, so the kill lands inside one
    save_checkpoint_file({"version": version, "weights": torch.randn(8_000_000)}, path)
    version += 1
"""


@pytest.mark.timeout(60)
def test_killing_the_writer_keeps_a_whole_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    # Wait until a big write is under way (a temporary file exists), then kill.
    deadline = time.monotonic() + 20
    while not list(tmp_path.glob(".last.ckpt.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    checkpoint = load_checkpoint_file(path)
    assert isinstance(checkpoint["version"], int)
    assert checkpoint["weights"].numel() in (4, 8_000_000)


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    save_checkpoint_file({"ok": torch.ones(1)}, path)
    with pytest.raises(Exception, match=r"pickle|lambda|Can't"):
        save_checkpoint_file({"bad": lambda: None}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]
    assert torch.equal(load_checkpoint_file(path)["ok"], torch.ones(1))
