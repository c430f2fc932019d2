"""A one-machine job listens on loopback only: the rendezvous store, the watchdog's store and
gloo's own sockets, found through the job's processes while it trains."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from accord.errors import CollectiveError
from tests.helpers.processes import ROOT

# Rank 0 is the launching process; mid-fit it lists every TCP listener that it and the
# ranks it started own, and writes them to the file named by argv[1].
SCRIPT = f"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, {str(ROOT)!r})

from tests.helpers.models import LinearModel, loader
from tests.reliability.test_loopback import job_listeners

import accord


class Inspecting(LinearModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == 0:
            Path(sys.argv[1]).write_text(json.dumps(job_listeners(os.getpid())))
        return super().training_step(batch, batch_idx)


trainer = accord.Trainer(
    strategy="ddp",
    accelerator="cpu",
    devices=2,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
trainer.fit(Inspecting(), loader(16))
"""


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6 stores the address as four host-order 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def job_listeners(root: int) -> list[dict[str, object]]:
    """Every listening TCP socket owned by ``root`` or its descendants: pid, address, port."""
    owners = {inode: pid for pid in _descendants(root) for inode in _socket_inodes(pid)}
    listeners: list[dict[str, object]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in owners:  # 0A: LISTEN
                continue
            host, port = local.rsplit(":", 1)
            listeners.append(
                {"pid": owners[inode], "address": _address(host), "port": int(port, 16)}
            )
    return listeners


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
@pytest.mark.timeout(240)
def test_a_local_ddp_fit_listens_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    out = tmp_path / "listeners.json"
    env = {**os.environ, "ACCORD_COLLECTIVE_TIMEOUT": "120"}  # the watchdog's store too
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listeners = json.loads(out.read_text())
    # The rendezvous store and the watchdog's store, at least: the check saw the job.
    assert len({entry["port"] for entry in listeners}) >= 2, listeners
    outside = [entry for entry in listeners if not _is_loopback(str(entry["address"]))]
    assert not outside, f"listeners outside 127.0.0.0/8: {outside}"


def test_listen_on_loopback_binds_only_loopback_names() -> None:
    from accord.core.rendezvous import listen_on_loopback

    fd = listen_on_loopback("127.0.0.1", 0)
    assert fd is not None
    with socket.socket(fileno=fd) as listener:
        assert listener.getsockname()[0] == "127.0.0.1"
    # Not a loopback address: torch's own binding (every interface) stays.
    assert listen_on_loopback("0.0.0.0", 0) is None
    assert listen_on_loopback("192.0.2.1", 0) is None


def test_a_taken_port_is_named() -> None:
    from accord.core.rendezvous import listen_on_loopback

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CollectiveError, match=rf"127\.0\.0\.1:{port}.*pick a free one"):
            listen_on_loopback("127.0.0.1", port)
