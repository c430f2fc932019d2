"""The Trainer, the connector that turns its arguments into a strategy, and what a run's
rank zero hands back to a launching process."""

from accord.trainer.connector import connect, detect_cluster_environment
from accord.trainer.state import RankZeroResults
from accord.trainer.trainer import Trainer

__all__ = ["RankZeroResults", "Trainer", "connect", "detect_cluster_environment"]
