"""accord: a PyTorch trainer whose training strategies each own a composed collective."""

import accord.launchers
import accord.log  # noqa: F401  (the "accord" logger: INFO and up, on stderr until configured)
from accord.datamodule import DataModule
from accord.module import Module
from accord.seed import seed_everything
from accord.trainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = ["DataModule", "Module", "Trainer", "__version__", "seed_everything"]
