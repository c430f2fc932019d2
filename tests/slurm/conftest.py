"""The SLURM lane: accord through a real ``srun``/``sbatch``/``salloc``.

Every test in this folder is marked ``slurm`` and skips, saying why, when no SLURM cluster
answers (``make test-slurm`` starts one on this machine: scripts/slurm_cluster.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_jobs import slurm_problem


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``slurm``; skip them where no cluster answers."""
    here = Path(__file__).resolve().parent
    mine = [item for item in items if here in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    problem = slurm_problem()
    for item in mine:
        item.add_marker(pytest.mark.slurm)
        if problem is not None:
            item.add_marker(pytest.mark.skip(reason=f"SLURM cannot run here: {problem}"))
