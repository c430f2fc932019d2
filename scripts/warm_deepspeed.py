"""Build DeepSpeed's CPU communication extension once, outside any test's time limit.

DeepSpeed compiles a shared-memory extension the first time `init_distributed` runs on a
CPU machine (about a minute on two cores) and caches it in ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import os

from accord.environments.local import find_free_port


def main() -> None:
    try:
        import deepspeed
    except ImportError:
        print("deepspeed is not installed; nothing to build")
        return
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
