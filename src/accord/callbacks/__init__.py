"""Callbacks: EarlyStopping, ModelCheckpoint, the progress bar, and the base class."""

from accord.callbacks.callback import Callback
from accord.callbacks.early_stopping import EarlyStopping
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.progress import ProgressBar

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "ProgressBar"]
