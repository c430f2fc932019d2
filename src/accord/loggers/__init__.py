"""Loggers: where logged metrics are written (on global rank zero).

Lightning's loggers that accord does not provide are listed in `NOT_PROVIDED`; importing
one raises an `ImportError` that says why and what to do instead.
"""

from typing import NoReturn

from accord.loggers.csv import CSVLogger
from accord.loggers.logger import Logger
from accord.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "NOT_PROVIDED", "TensorBoardLogger"]

_SERVICE = "it sends the run to a hosted tracking service, and accord ships no client for one"

NOT_PROVIDED: dict[str, tuple[str, str]] = {
    "CometLogger": (
        _SERVICE,
        "subclass accord.loggers.Logger and call comet_ml's Experiment.log_metrics and "
        "log_parameters in log_metrics and log_hyperparams",
    ),
    "LitLogger": (
        _SERVICE,
        "subclass accord.loggers.Logger and call the litlogger client in log_metrics and "
        "log_hyperparams",
    ),
    "MLFlowLogger": (
        _SERVICE,
        "subclass accord.loggers.Logger and call mlflow.log_metrics(metrics, step=step) and "
        "mlflow.log_params in log_metrics and log_hyperparams",
    ),
    "NeptuneLogger": (
        "Neptune's service has shut down (Lightning 2.6's NeptuneLogger only raises)",
        "use CSVLogger or TensorBoardLogger",
    ),
    "WandbLogger": (
        _SERVICE,
        "log with TensorBoardLogger and call wandb.init(sync_tensorboard=True) first, or "
        "subclass accord.loggers.Logger and call wandb.log in log_metrics",
    ),
}
"""Lightning 2.6's loggers accord does not provide: name -> (why, what to do instead)."""


def __getattr__(name: str) -> NoReturn:
    # `from accord.loggers import X` keeps this message only for an ImportError.
    if name in NOT_PROVIDED:
        why, instead = NOT_PROVIDED[name]
        raise ImportError(
            f"{name} is a Lightning logger that accord does not provide: {why}. "
            f"Instead, {instead}.",
            name=__name__,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
