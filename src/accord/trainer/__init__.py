"""The Trainer, and the connector that turns its arguments into a strategy."""

from accord.trainer.connector import connect, detect_cluster_environment
from accord.trainer.trainer import Trainer

__all__ = ["Trainer", "connect", "detect_cluster_environment"]
