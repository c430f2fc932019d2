"""Public test kit: multi-process helpers and the collective conformance suite."""

from accord.testing.multiprocess import run_distributed

__all__ = ["run_distributed"]
