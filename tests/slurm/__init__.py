"""The SLURM lane: real jobs on a one-node cluster (make test-slurm)."""
