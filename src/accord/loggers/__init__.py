"""Loggers: where logged metrics are written (on global rank zero)."""

from accord.loggers.csv import CSVLogger
from accord.loggers.logger import Logger
from accord.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
