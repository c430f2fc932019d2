"""Callbacks: checkpoints, early stopping, the progress bar, the LR monitor, the model
summary, accumulation schedules, a time budget, and the base class."""

from accord.callbacks.callback import Callback
from accord.callbacks.early_stopping import EarlyStopping
from accord.callbacks.gradient_accumulation import GradientAccumulationScheduler
from accord.callbacks.lr_monitor import LearningRateMonitor
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.model_summary import LayerSummary, ModelSummary, summarize
from accord.callbacks.progress import ProgressBar
from accord.callbacks.timer import Timer

__all__ = [
    "Callback",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LayerSummary",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "Timer",
    "summarize",
]
