"""A process that ends while gloo's worker threads still hold an op's tensors exits cleanly.

gloo's workers free an op's tensors after the op completed; a tensor whose Python object
died first needs the GIL there, and a thread asking for the GIL while the interpreter
shuts down aborts the process ("terminate called without an active exception"), after a
run that succeeded. Here rank 0 drops an all_reduce handle its peer has not joined yet and
exits (or tears down) at once: both processes must exit with status 0.

A gloo op also keeps its caller's thread-local state, and one started during a backward
pass (as DDP's and FSDP's gradient reductions are) holds autograd's Python context there:
the worker drops it after the op, taking the GIL. In the second test the ranks start such
an op and keep the GIL (a long switch interval, a busy loop) until they exit, so the
worker can only let go while the process exits.
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


BACKWARD_SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.distributed as dist

    from accord.collectives import TorchCollective

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    TorchCollective().setup(rank=rank, world_size=2, main_port=port)
    kept = []  # the tensors stay alive: only the op's thread-local state is left to drop

    def reduce_during_backward(grad):
        kept.append(torch.ones(4))
        dist.all_reduce(kept[-1], async_op=True)
        return grad

    weight = torch.ones(4, requires_grad=True)
    weight.register_hook(reduce_during_backward)
    (weight * 2).sum().backward()
    sys.setswitchinterval(100.0)  # this thread keeps the GIL from gloo's worker
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        pass
    print("rank", rank, "leaves", flush=True)
    """
)


def _run_two_ranks(script: str, *arguments: str) -> list[str]:
    """Run ``script`` as ranks 0 and 1; each must exit with status 0, without an abort."""
    port = str(find_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), port, *arguments],
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
    return outputs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["exit", "teardown"])
def test_a_process_leaving_with_an_op_in_flight_exits_cleanly(ending: str) -> None:
    outputs = _run_two_ranks(SCRIPT, ending)
    assert "[2.0, 2.0, 2.0, 2.0]" in outputs[1]


@pytest.mark.timeout(120)
def test_a_process_leaving_while_a_worker_holds_a_backward_pass_state_exits_cleanly() -> None:
    _run_two_ranks(BACKWARD_SCRIPT)
