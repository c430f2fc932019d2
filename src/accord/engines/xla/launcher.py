"""`XLALauncher`: start the XLA ranks with torch_xla's own launcher, ``xmp.spawn``.

``xmp.spawn`` starts one process per chip (on the CPU runtime: one process) and, in each,
one thread per device, after setting up the runtime's replication. Every rank unpickles
its own copy of the work (the Trainer, the model, the data), because ranks that are
threads of one process would otherwise train the same objects. As under
`MultiprocessingLauncher`, the launching process does not train: `launch` returns what
the work returned on rank zero, with its XLA tensors moved to the CPU.

A rank that fails writes its traceback beside the results, and its process ends after a
grace period, since the other ranks wait for it inside a collective; the launcher then
raises `RankFailureError` naming the rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError, RankFailureError
from accord.launchers.multiprocessing import MultiprocessingLauncher

__all__ = ["XLALauncher"]

_RESULT = "rank0.pkl"


def _error_file(directory: str, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.error"


def _rank_main(index: int, work: bytes, directory: str, grace: float) -> None:
    """One rank of an ``xmp.spawn`` run (module level, so the process pool can pickle it)."""
    from accord.core.strategy import move_to_device

    # A process that XLA aborts, or that crashes, writes every thread's Python stack to
    # stderr: the launcher only learns that the process pool lost it.
    with contextlib.suppress(RuntimeError, OSError, ValueError):  # a stderr without a file
        faulthandler.enable()
    fn, args, kwargs = pickle.loads(work)  # this rank's own copies
    try:
        result = fn(*args, **kwargs)
        if index == 0:
            # XLA tensors go home as CPU tensors: unpickling an XLA tensor in the launching
            # process would start the runtime there, and no later fit could launch ranks.
            body = pickle.dumps(move_to_device(result, torch.device("cpu")))
            target = Path(directory) / _RESULT
            partial = target.with_suffix(".tmp")
            partial.write_bytes(body)  # plain pickle copies tensor data
            partial.replace(target)
    except BaseException as err:
        _error_file(directory, index).write_text(
            f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        )
        # The other ranks may be waiting for this one inside a collective: end the process
        # after the grace period, so the launcher reports the failure instead of hanging.
        threading.Thread(target=_exit_after, args=(grace,), daemon=True).start()
        raise


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(1)


class XLALauncher(MultiprocessingLauncher):
    """Start ``num_processes`` XLA ranks with ``xmp.spawn`` and wait for them.

    ``xmp.spawn`` always uses every device of the runtime. On the CPU runtime that count
    is ``CPU_NUM_DEVICES``, which this launcher sets to ``num_processes`` for the ranks
    (one set to another value is an error); on TPUs ``num_processes`` must match the
    devices of the host.

    Args:
        cluster_environment: the `XLAEnvironment` of the strategy.
        num_processes: ranks on this host (one per XLA device).
        failure_grace: seconds the other ranks get to stop after one failed.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        failure_grace: float = 5.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, "spawn", 1, failure_grace)

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise ConfigurationError(
                "The XLA runtime already runs in this process, and torch_xla can only launch "
                "ranks before it starts. Do not touch the XLA device before trainer.fit() "
                "with devices > 1 (or run one process per rank under your own xmp.spawn)."
            )
        env = self._cpu_runtime_env() if xr.device_type() == "CPU" else {}
        work = pickle.dumps((fn, args, kwargs))
        directory = tempfile.mkdtemp(prefix="accord-xla-")
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # the spawned process inherits it
        try:
            try:
                xmp.spawn(_rank_main, args=(work, directory, self.failure_grace))
            except BaseException as err:
                self._raise_rank_failure(directory, err)
                raise
            self._raise_rank_failure(directory, None)
            result = pickle.loads((Path(directory) / _RESULT).read_bytes())
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            shutil.rmtree(directory, ignore_errors=True)
        return result

    def _cpu_runtime_env(self) -> dict[str, str]:
        """The variables the ranks' process needs on XLA's CPU runtime."""
        wanted = str(self.num_processes)
        current = os.environ.get("CPU_NUM_DEVICES")
        if current is not None and current != wanted:
            raise ConfigurationError(
                f"CPU_NUM_DEVICES={current} but the Trainer asks for devices="
                f"{self.num_processes}. Unset CPU_NUM_DEVICES or pass devices={current}."
            )
        # Each rank's collective occupies a thread of torch_xla's pool while it waits for
        # the other ranks; a pool smaller than the ranks (its default is the core count)
        # leaves the last rank's collective queued behind the others forever.
        pool = os.environ.get("XLA_THREAD_POOL_SIZE", str(max(16, 4 * self.num_processes)))
        return {"CPU_NUM_DEVICES": wanted, "XLA_THREAD_POOL_SIZE": pool}

    def _raise_rank_failure(self, directory: str, cause: BaseException | None) -> None:
        # The first rank to fail is the cause; later ones mostly saw it disappear.
        reports = sorted(Path(directory).glob("rank*.error"), key=lambda p: p.stat().st_mtime)
        failed = [int(path.stem.removeprefix("rank")) for path in reports]
        if not failed:
            if cause is not None and not isinstance(cause, Exception):
                return  # KeyboardInterrupt and the like: let it through as it is
            if cause is not None:
                raise RankFailureError(
                    f"The XLA ranks' process died without a rank reporting an error: {cause} "
                    "Its output above says why: XLA's own message, and each thread's Python "
                    "stack when the process crashed."
                ) from cause
            return
        first = failed[0]
        also = f" (ranks {sorted(failed[1:])} failed too)" if len(failed) > 1 else ""
        message = _error_file(directory, first).read_text()
        raise RankFailureError(f"Rank {first} failed{also}:\n{message}") from cause
