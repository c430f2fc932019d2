"""Which hooks a run calls, resolved once per run, and the check of the names a user wrote.

A run's `RunHooks` looks at the module's, the callbacks' and the datamodule's classes once
and keeps, per hook name, only the methods someone overrode: a loop asks for
``hooks.event("on_train_batch_start")`` before its first batch and calls what it got, so
a hook nobody defined costs nothing per batch. `check_hook_names` warns, at the start of a
run, about a method that looks like a hook but is none that accord calls (a typo such as
``on_validation_epoch_ends``), with the closest known name.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from accord.callbacks.callback import Callback
from accord.callbacks.checkpoint import Checkpoint
from accord.callbacks.early_stopping import EarlyStopping
from accord.datamodule import DataModule
from accord.module import Module
from accord.trainer.lightning_names import REFUSED_MODULE_NAMES

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = ["CALLBACK_HOOKS", "MODULE_HOOKS", "RunHooks", "check_hook_names", "overridden"]

CALLBACK_HOOKS: tuple[str, ...] = tuple(
    name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")
)
"""Every hook the Trainer calls on a `Callback` (Lightning's, all of them)."""

MODULE_HOOKS: tuple[str, ...] = (
    *(name for name in dir(Module) if name.startswith("on_")),
    "setup",
    "teardown",
    "prepare_data",
    "configure_model",
    "configure_callbacks",
    "configure_optimizers",
    "configure_gradient_clipping",
    "optimizer_step",
    "optimizer_zero_grad",
    "lr_scheduler_step",
    "backward",
    "transfer_batch_to_device",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
)
"""The `Module` methods the Trainer calls (hooks, steps, loaders)."""

# Callbacks that watch a logged metric run their ``on_train_epoch_end`` after the module's,
# so they see what the module logged there (Lightning's order).
_MONITORING = (Checkpoint, EarlyStopping)


def overridden(obj: object, base: type, name: str) -> bool:
    """Whether ``obj``'s class (or the instance itself) defines ``name`` instead of ``base``."""
    return getattr(type(obj), name, None) is not getattr(base, name, None) or name in vars(obj)


def _monitors(callback: Callback) -> bool:
    return isinstance(callback, _MONITORING)


class RunHooks:
    """The overridden hooks of one run, by name, in Lightning's call order.

    Args:
        trainer: the Trainer of the run (passed first to every callback hook).
        module: the user's module.
        callbacks: the run's callbacks, in order.
        datamodule: the run's `DataModule`, if any; its batch-transfer hooks win over the
            module's when it overrides them, as in Lightning.
    """

    def __init__(
        self,
        trainer: Trainer,
        module: Module,
        callbacks: Iterable[Callback],
        datamodule: DataModule | None,
    ) -> None:
        self.trainer = trainer
        self.module = module
        self.callbacks = list(callbacks)
        self.datamodule = datamodule
        self._events: dict[str, tuple[Callable[..., Any], ...]] = {}

    def callback_hooks(
        self, name: str, *, monitoring: bool | None = None
    ) -> tuple[Callable[..., Any], ...]:
        """The callbacks' overridden ``name``, with the trainer and module bound first.

        ``monitoring``: None for every callback, True or False for only those that do (or
        do not) watch a metric.
        """
        return tuple(
            functools.partial(getattr(cb, name), self.trainer, self.module)
            for cb in self.callbacks
            if overridden(cb, Callback, name)
            and (monitoring is None or _monitors(cb) == monitoring)
        )

    def module_hook(self, name: str) -> Callable[..., Any] | None:
        """The module's ``name`` where its class overrides it, else None."""
        if not overridden(self.module, Module, name):
            return None
        method: Callable[..., Any] = getattr(self.module, name)
        return method

    def event(self, name: str) -> tuple[Callable[..., Any], ...]:
        """What to call for ``name``: the callbacks' hooks, then the module's (for
        ``on_train_epoch_end``: the other callbacks, the module, then the monitoring ones)."""
        found = self._events.get(name)
        if found is None:
            own = self.module_hook(name)
            mine = (own,) if own is not None else ()
            if name == "on_train_epoch_end":
                found = (
                    *self.callback_hooks(name, monitoring=False),
                    *mine,
                    *self.callback_hooks(name, monitoring=True),
                )
            else:
                found = (*self.callback_hooks(name), *mine)
            self._events[name] = found
        return found

    def call(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call every hook of `event` ``name`` with ``args`` and ``kwargs``."""
        for hook in self.event(name):
            hook(*args, **kwargs)

    def batch_hook(self, name: str) -> Callable[..., Any] | None:
        """The datamodule's batch-transfer hook ``name`` where it overrides it, else the
        module's where it does, else None."""
        datamodule = self.datamodule
        if datamodule is not None and overridden(datamodule, DataModule, name):
            if overridden(self.module, Module, name):
                rank_zero_warn(
                    f"{type(self.module).__name__} and {type(datamodule).__name__} both define "
                    f"{name}(); the datamodule's is used, as in Lightning.",
                    category=UserWarning,
                )
            method: Callable[..., Any] = getattr(datamodule, name)
            return method
        return self.module_hook(name)


def check_hook_names(module: Module, callbacks: Iterable[Callback]) -> None:
    """Warn, on rank zero, about a method that looks like a hook accord does not call.

    A method of the module's or a callback's class that starts with ``on_`` and is no
    hook of accord's (nor of the class's own base), or one a letter or two from a hook
    name, gets a warning naming the closest hook. Lightning names accord refuses raise.

    Raises:
        ConfigurationError: the module overrides a Lightning method accord refuses
            (`accord.trainer.lightning_names.REFUSED_MODULE_NAMES`).
    """
    from accord.errors import ConfigurationError

    for name in _own_methods(module, Module):
        if name in REFUSED_MODULE_NAMES:
            raise ConfigurationError(
                f"{type(module).__name__}.{name}() is a Lightning hook accord does not call: "
                f"{REFUSED_MODULE_NAMES[name]}"
            )
    _warn_unknown(module, Module, MODULE_HOOKS, "module")
    for callback in callbacks:
        _warn_unknown(callback, Callback, CALLBACK_HOOKS, "callback")


def _own_methods(obj: object, base: type) -> list[str]:
    """The public callables ``obj``'s classes below ``base`` define."""
    names: dict[str, None] = {}
    for cls in type(obj).__mro__:
        if cls is base or issubclass(base, cls):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and callable(value):
                names[name] = None
    return list(names)


def _warn_unknown(obj: object, base: type, known: tuple[str, ...], kind: str) -> None:
    for name in _own_methods(obj, base):
        if name in known or hasattr(base, name):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if not name.startswith("on_") and not close:
            continue
        hint = f" Did you mean {close[0]!r}?" if close else ""
        rank_zero_warn(
            f"{type(obj).__name__}.{name}() looks like a {kind} hook, but accord never calls "
            f"a hook of that name, so it will not run.{hint} The hooks accord calls are "
            "listed in docs/from-lightning.md; rename the method, or ignore this warning if "
            "you call it yourself.",
            category=UserWarning,
        )
