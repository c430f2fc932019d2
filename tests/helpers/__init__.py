"""Helpers shared by the test modules and by the scripts the tests start.

- `tests.helpers.models`: small models, data and a counting collective.
- `tests.helpers.processes`: the repository root and `run_python`, for tests that start a
  script in a fresh interpreter.
- `tests.helpers.slurm`: commands, jobs and marks of the SLURM lane.
"""
