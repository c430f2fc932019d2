"""Callbacks: checkpoints, early stopping, progress bars, the LR monitor, the model summary,
accumulation schedules, a time budget, prediction writers, and the base classes.

Lightning's callbacks that accord does not provide are listed in `NOT_PROVIDED`;
importing one raises an `ImportError` that says why and what to do instead.
"""

from typing import NoReturn

from accord.callbacks.callback import Callback
from accord.callbacks.checkpoint import Checkpoint
from accord.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from accord.callbacks.gradient_accumulation import GradientAccumulationScheduler
from accord.callbacks.lambda_function import LambdaCallback
from accord.callbacks.lr_monitor import LearningRateMonitor
from accord.callbacks.model_checkpoint import ModelCheckpoint
from accord.callbacks.model_summary import LayerSummary, ModelSummary, summarize
from accord.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from accord.callbacks.prediction_writer import BasePredictionWriter, WriteInterval
from accord.callbacks.progress import ProgressBar, TQDMProgressBar
from accord.callbacks.timer import Timer

__all__ = [
    "BasePredictionWriter",
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "EarlyStoppingReason",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LayerSummary",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "NOT_PROVIDED",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "TQDMProgressBar",
    "Timer",
    "WriteInterval",
    "summarize",
]

_AVERAGE = (
    "it keeps a second, averaged copy of the weights that the Trainer swaps into the model "
    "for validation and at the end of fit, a step accord's loop does not have"
)
_UNFREEZE = (
    "it unfreezes parameters and adds them to the running optimizer mid-fit, which accord's "
    "strategies cannot follow once they wrapped the model (DDP registers its gradient hooks, "
    "FSDP and DeepSpeed shard the parameters, when the fit starts)"
)

NOT_PROVIDED: dict[str, tuple[str, str]] = {
    "BackboneFinetuning": (
        _UNFREEZE,
        "fit in stages: a first fit with the backbone frozen (requires_grad_(False)), then "
        "load its weights (load_from_checkpoint) and fit again with the backbone unfrozen",
    ),
    "BaseFinetuning": (
        _UNFREEZE,
        "freeze with requires_grad_(False) before a fit and unfreeze between fits",
    ),
    "BatchSizeFinder": (
        "it needs Lightning's Tuner, which reruns the fit with new loaders and restores it; "
        "accord has no tuner",
        "run a few short fits (limit_train_batches) with growing batch sizes and keep the "
        "largest that fits in memory",
    ),
    "DeviceStatsMonitor": (
        "accord's accelerators report no device statistics",
        "log what you need from a hook, e.g. self.log('mem', torch.cuda.memory_allocated()) "
        "in on_train_batch_end",
    ),
    "EMAWeightAveraging": (
        _AVERAGE,
        "keep a torch.optim.swa_utils.AveragedModel(model, "
        "multi_avg_fn=get_ema_multi_avg_fn(decay)) in your module, update it in "
        "on_train_batch_end, and evaluate or save it yourself",
    ),
    "LearningRateFinder": (
        "it needs Lightning's Tuner, which runs a trial fit and restores the model; accord "
        "has no tuner",
        "run a short fit with torch.optim.lr_scheduler.ExponentialLR and LearningRateMonitor, "
        "and pick the rate where the logged loss falls fastest",
    ),
    "ModelPruning": (
        "torch.nn.utils.prune re-parametrizes the weights, which renames them in the state "
        "dict (weight_orig, weight_mask) and which the sharding strategies do not support",
        "prune with torch.nn.utils.prune in your own callback and call prune.remove before "
        "each save",
    ),
    "RichModelSummary": (
        "it draws with the rich package, which accord does not use",
        "use ModelSummary (the same table as text)",
    ),
    "RichProgressBar": (
        "it draws with the rich package, which accord does not use",
        "use TQDMProgressBar, the default",
    ),
    "SpikeDetection": (
        "accord has no loss-spike detection",
        "Trainer(on_nonfinite=...) handles non-finite losses; for spikes compare the loss "
        "with a running mean in on_train_batch_end and raise",
    ),
    "StochasticWeightAveraging": (
        "it changes the learning rate schedule, swaps the averaged weights into the model "
        "and runs an extra pass to recompute batch-norm statistics at the end of fit, steps "
        "accord's loop does not have",
        "keep a torch.optim.swa_utils.AveragedModel in your module with SWALR as a scheduler, "
        "update it in on_train_epoch_end, and call torch.optim.swa_utils.update_bn after fit",
    ),
    "ThroughputMonitor": (
        "it is built on Fabric's throughput counters, which accord does not have",
        "time batches with time.perf_counter in on_train_batch_start and on_train_batch_end "
        "and self.log the samples per second",
    ),
    "WeightAveraging": (
        _AVERAGE,
        "keep a torch.optim.swa_utils.AveragedModel in your module and update it in "
        "on_train_batch_end",
    ),
}
"""Lightning 2.6's callbacks accord does not provide: name -> (why, what to do instead)."""


def __getattr__(name: str) -> NoReturn:
    # `from accord.callbacks import X` keeps this message only for an ImportError.
    if name in NOT_PROVIDED:
        why, instead = NOT_PROVIDED[name]
        raise ImportError(
            f"{name} is a Lightning callback that accord does not provide: {why}. "
            f"Instead, {instead}.",
            name=__name__,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
