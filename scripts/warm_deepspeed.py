"""Build DeepSpeed's CPU communication extension once, outside any test's time limit.

DeepSpeed compiles a shared-memory extension the first time it starts on a CPU machine
(45-95 s on two cores) and caches it in ``$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm``, or
under ``~/.cache/torch_extensions/`` when the variable is unset. This script runs that same
build now and says where it went; the Makefile points ``TORCH_EXTENSIONS_DIR`` at
``.venv/torch_extensions``. Outside a checkout,
``python -m accord.engines.deepspeed.extension`` does the same.
"""

from __future__ import annotations

from accord.engines.deepspeed.extension import main

if __name__ == "__main__":
    main()
