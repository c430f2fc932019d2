"""Cluster environments: how a process learns its rank, node and rendezvous address."""

from accord.core.lazy import lazy_exports
from accord.environments.cluster_environment import ClusterEnvironment
from accord.environments.local import LocalEnvironment, find_free_port
from accord.environments.slurm import SLURMEnvironment
from accord.environments.torchelastic import TorchElasticEnvironment

__getattr__ = lazy_exports(__name__, {"XLAEnvironment": "accord.engines.xla.environment"})

__all__ = [
    "ClusterEnvironment",
    "LocalEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "XLAEnvironment",
    "find_free_port",
]
