"""Failures, checkpoints, preemption and bad input: what happens when things go wrong."""
