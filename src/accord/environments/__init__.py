"""Cluster environments: how a process learns its rank, node and rendezvous address."""

from accord.environments.cluster_environment import ClusterEnvironment
from accord.environments.local import LocalEnvironment, find_free_port
from accord.environments.slurm import SLURMEnvironment
from accord.environments.torchelastic import TorchElasticEnvironment
from accord.environments.xla import XLAEnvironment

__all__ = [
    "ClusterEnvironment",
    "LocalEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "XLAEnvironment",
    "find_free_port",
]
