"""How a Trainer entry point becomes a run: the loaders it resolves, the dispatch to the
strategy's launcher, and the `RankZeroResults` a launched run hands back to the process
that launched it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accord.core.strategy import Strategy
from accord.datamodule import DataModule, check_datamodule
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.launchers.supervisor import SupervisingLauncher
from accord.log import rank_zero_info
from accord.module import Module
from accord.precision import Precision
from accord.trainer.compile import unwrap_compiled
from accord.trainer.data import overrides
from accord.trainer.hooks import overridden
from accord.trainer.manual_loop import check_manual
from accord.trainer.recovery import restart_checkpoint
from accord.trainer.run import run_stage
from accord.trainer.state import RankZeroResults

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

log = logging.getLogger(__name__)

__all__: list[str] = []


def apply_plugins(
    strategy: Strategy, precision: Precision | None, environment: ClusterEnvironment | None
) -> None:
    """Give ``strategy`` the precision and cluster environment passed as ``plugins=``."""
    if precision is not None:
        strategy.precision = precision
        strategy.precision_given = True
    if environment is not None:
        strategy.cluster_environment = environment


def check_weights_only(weights_only: bool | None) -> None:
    """Refuse ``weights_only=False``: the Trainer reads checkpoints without running code.

    Raises:
        ConfigurationError: ``weights_only=False``.
    """
    if weights_only is False:
        raise ConfigurationError(
            "weights_only=False is not supported by the Trainer: accord checkpoints load "
            "with weights_only=True (no code runs). To load a trusted file that needs "
            "pickled objects, use Module.load_from_checkpoint(path, weights_only=False)."
        )


def fit_loaders(
    trainer: Trainer,
    model: Module,
    train_dataloaders: Iterable[Any] | DataModule | None,
    val_dataloaders: Iterable[Any] | None,
    datamodule: DataModule | None,
) -> tuple[Module, Iterable[Any] | None, Iterable[Any] | None]:
    """``Trainer.fit``'s module (the one inside a ``torch.compile``), and its training and
    validation loaders as given (None where the module's or the datamodule's hooks give
    them on each rank); refuses a fit without data, or a manual-optimization fit the
    Trainer cannot run, before any process starts."""
    if isinstance(train_dataloaders, DataModule):
        datamodule = check_datamodule("fit", datamodule, None, train_dataloaders)
        train_dataloaders = None
    trainer.datamodule = check_datamodule("fit", train_dataloaders, val_dataloaders, datamodule)
    model = _module(trainer, "fit", model)
    if (
        trainer.datamodule is None
        and train_dataloaders is None
        and not overrides(model, "train_dataloader")
    ):
        raise ConfigurationError(
            f"fit() got no training data and {type(model).__name__} has no train_dataloader(). "
            "Pass train_dataloaders= (or a datamodule), or define train_dataloader() on the "
            "module."
        )
    # Before any process starts, so a refusal is raised here, not by every rank.
    check_module_hooks(trainer, model)
    if not model.automatic_optimization:
        check_manual(trainer)
    return model, train_dataloaders, val_dataloaders


def check_module_hooks(trainer: Trainer, model: Module) -> None:
    """Refuse a module that overrides a hook the strategy cannot honour.

    Raises:
        ConfigurationError: e.g. ``backward`` or ``configure_gradient_clipping`` under
            DeepSpeed, whose engine runs them itself.
    """
    strategy = trainer.strategy
    for name, reason in strategy.refused_module_hooks().items():
        if overridden(model, Module, name):
            raise ConfigurationError(
                f"{type(model).__name__} overrides {name}(), which {type(strategy).__name__} "
                f"cannot honour: {reason} Remove the override, or use another strategy "
                "(ddp, fsdp)."
            )


def _module(trainer: Trainer, stage: str, model: Module | None) -> Module:
    """``model`` (the `Module` inside when it is ``torch.compile``'d), or the last run's
    module when None.

    Raises:
        ConfigurationError: no module given and none known, not an accord `Module`, or a
            compiled one the strategy cannot train.
    """
    if model is None:
        model = trainer.lightning_module
        if model is None:
            raise ConfigurationError(
                f"Trainer.{stage}() needs a model: pass one, or call fit() with this Trainer first."
            )
    # torch.compile(module) gives the module inside, its steps compiled (or a refusal).
    return unwrap_compiled(model, trainer.strategy)


def eval_loader(
    trainer: Trainer,
    stage: str,
    dataloaders: Iterable[Any] | DataModule | None,
    datamodule: DataModule | None,
) -> Iterable[Any] | None:
    """The loader of ``stage`` as given; None when a datamodule or the module's hook gives
    it on each rank."""
    if isinstance(dataloaders, DataModule):
        datamodule = check_datamodule(stage, datamodule, None, dataloaders)
        dataloaders = None
    trainer.datamodule = check_datamodule(stage, dataloaders, None, datamodule)
    return dataloaders


def launch(trainer: Trainer, stage: str, model: Module, *args: Any) -> Any:
    """Run ``stage`` here or through the strategy's launcher; return its output (taking
    rank zero's results into this process when the ranks ran elsewhere)."""
    model = _module(trainer, stage, model)
    trainer._state.module = model
    launcher = trainer.strategy.launcher
    survive = stage == "fit" and trainer.on_rank_loss == "continue"
    if (
        launcher is None
        and survive
        and SupervisingLauncher.wanted(trainer.strategy.cluster_environment)
    ):
        # torchrun (or SLURM) started this rank: its loss must not end this process.
        launcher = SupervisingLauncher(trainer.strategy.cluster_environment)  # type: ignore[arg-type]
    if launcher is None:
        return trainer._run(stage, model, *args)
    launcher.survive_rank_loss = survive
    if launcher.runs_in_caller:
        return launcher.launch(trainer._run, stage, model, *args)
    results: RankZeroResults | None = launcher.launch(trainer._run_rank, stage, model, *args)
    if results is None:
        return None
    trainer.apply_rank_zero_results(results)
    return results.output


def evaluate(
    trainer: Trainer,
    stage: str,
    model: Module | None,
    dataloaders: Iterable[Any] | DataModule | None,
    datamodule: DataModule | None,
    ckpt_path: str | Path | None,
    verbose: bool,
) -> Any:
    """``Trainer.validate``/``test``/``predict``: resolve the model and loader, launch
    ``stage``, return its output. Without a model the last fit's module is used, from its
    best checkpoint when a `ModelCheckpoint` saved one (as Lightning does)."""
    if model is None and ckpt_path is None:
        callback = trainer.checkpoint_callback
        if callback is not None and callback.best_model_path:
            ckpt_path = "best"
            rank_zero_info(
                log,
                "%s",
                f"Trainer.{stage}() got no model: using the last fit's module with the best "
                f"checkpoint, {callback.best_model_path}.",
            )
    model = _module(trainer, stage, model)
    loader = eval_loader(trainer, stage, dataloaders, datamodule)
    trainer._state.verbose = verbose
    return launch(trainer, stage, model, None, loader, ckpt_path)


def collect_results(trainer: Trainer, output: Any) -> RankZeroResults:
    """``Trainer.rank_zero_results``: the run's output, weights, metrics, callback states
    and counters."""
    module = trainer._state.module
    assert module is not None
    return RankZeroResults(
        output=output,
        state_dict={k: v.detach().cpu() for k, v in module.state_dict().items()},
        callback_metrics=dict(trainer.callback_metrics),
        progress_bar_metrics=dict(trainer.progress_bar_metrics),
        logged_metrics=dict(trainer.logged_metrics),
        callbacks={cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        current_epoch=trainer.current_epoch,
        global_step=trainer.global_step,
        collective_stats_by_rank=trainer.collective_stats_by_rank,
        membership=trainer.strategy.membership,
    )


def apply_results(trainer: Trainer, results: RankZeroResults) -> None:
    """``Trainer.apply_rank_zero_results``: take ``results`` into the model, the metrics,
    the callbacks and the counters."""
    state = trainer._state
    module = state.module
    if module is None:
        return
    module.load_state_dict(results.state_dict)
    metrics = state.metrics
    metrics.callback_metrics = results.callback_metrics
    metrics.progress_bar_metrics = results.progress_bar_metrics
    metrics.logged_metrics = results.logged_metrics
    for cb in trainer.callbacks:
        if cb.state_key in results.callbacks:
            cb.load_state_dict(results.callbacks[cb.state_key])
    trainer.current_epoch = results.current_epoch
    trainer.global_step = results.global_step
    trainer.collective_stats_by_rank = results.collective_stats_by_rank
    if results.membership is not None:
        trainer.strategy.membership = results.membership


def run(
    trainer: Trainer,
    stage: str,
    model: Module,
    train_loader: Iterable[Any] | None,
    eval_loader: Iterable[Any] | None,
    ckpt_path: str | Path | None,
) -> Any:
    """``Trainer._run``: run ``stage`` in this process; a fit without ``ckpt_path`` in a
    restarted job resumes from its newest checkpoint (``auto_resume``)."""
    if stage == "fit" and ckpt_path is None:
        ckpt_path = restart_checkpoint(trainer)
    return run_stage(trainer, trainer._state, stage, model, train_loader, eval_loader, ckpt_path)


def picklable_state(trainer: Trainer) -> dict[str, Any]:
    """``Trainer.__getstate__``: its attributes, with a run state stripped of what belongs
    to the run in progress (the wrapped model, optimizers, schedulers, loaders, hooks); the
    launching process keeps its own reference and children get a fresh copy."""
    state = dataclasses.replace(
        trainer._state,
        wrapped=None,
        optimizers=[],
        schedulers=[],
        hooks=None,
        train_loader=None,
        val_loader=None,
        eval_loaders={},
        prepare_train=None,
        survival=None,
    )
    return {**trainer.__dict__, "_state": state}
