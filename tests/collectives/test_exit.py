"""A process that ends while gloo's worker threads still hold an op's tensors exits cleanly.

gloo's workers free an op's tensors after the op completed; a tensor whose Python object
died first needs the GIL there, and a thread asking for the GIL while the interpreter
shuts down aborts the process ("terminate called without an active exception"), after a
run that succeeded. Here rank 0 drops an all_reduce handle its peer has not joined yet and
exits (or tears down) at once: both processes must exit with status 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from accord.environments.local import find_free_port

SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch

    from accord.collectives import TorchCollective

    rank, port, ending = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    collective = TorchCollective().setup(rank=rank, world_size=2, main_port=port)
    if rank == 1:
        time.sleep(1.0)  # rank 0 is on its way out by now
        print(collective.all_reduce(torch.ones(4), async_op=True).wait().tolist())
    else:
        collective.all_reduce(torch.ones(4), async_op=True)  # dropped, not waited for
    if ending == "teardown":
        collective.teardown()
    print("rank", rank, "leaves", flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["exit", "teardown"])
def test_a_process_leaving_with_an_op_in_flight_exits_cleanly(ending: str) -> None:
    port = str(find_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(rank), port, ending],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=90)[0] for rank in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert "terminate called" not in output, output
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{output}"
        assert f"rank {rank} leaves" in output
    assert "[2.0, 2.0, 2.0, 2.0]" in outputs[1]
