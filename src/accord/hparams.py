"""Hyperparameter handling behind `Module` and `DataModule`: the `AttributeDict` that
``hparams`` is, the reading of the calling ``__init__``'s arguments for
``save_hyperparameters``, the check of which values a checkpoint can hold,
``load_from_checkpoint``'s building of an object from a checkpoint, and the merged
hyperparameters the loggers get when a fit starts."""

from __future__ import annotations

import copy
import inspect
import io
import warnings
from argparse import Namespace
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from accord.checkpoint.compiled_names import module_names
from accord.checkpoint.reading import read_checkpoint
from accord.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    from accord.datamodule import DataModule
    from accord.loggers.logger import Logger
    from accord.module import Module

__all__ = [
    "AttributeDict",
    "HyperparametersMixin",
    "build_from_hparams",
    "checkpoint_hparams",
    "log_hyperparameters",
    "run_hyperparameters",
]

ModuleT = TypeVar("ModuleT", bound="Module")
T = TypeVar("T")


class AttributeDict(dict[str, Any]):
    """A dict whose keys read as attributes too: ``hparams.lr`` is ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"No hyperparameter {key!r}; saved: {sorted(self)}.") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class _HasHparams(Protocol):
    @property
    def hparams(self) -> AttributeDict: ...


class HyperparametersMixin:
    """``save_hyperparameters`` and what goes with it, shared by `Module` and
    `DataModule` (Lightning's mixin of the same name)."""

    _log_hyperparams: bool = True

    @property
    def hparams(self) -> AttributeDict:
        """The hyperparameters `save_hyperparameters` recorded (empty until it is called)."""
        found: AttributeDict | None = self.__dict__.get("_hparams")
        if found is None:
            found = AttributeDict()
            self.__dict__["_hparams"] = found
        return found

    @property
    def hparams_initial(self) -> AttributeDict:
        """A copy of the hyperparameters as `save_hyperparameters` recorded them (changes
        to ``hparams`` since do not show here)."""
        return AttributeDict(copy.deepcopy(dict(self.__dict__.get("_hparams_initial", {}))))

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: str | Sequence[str] | None = None,
        frame: FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Record the ``__init__`` arguments as ``self.hparams``, as Lightning does.

        Call it in ``__init__``. Without ``args`` every argument of the ``__init__`` that
        calls it is recorded; with names (``save_hyperparameters("lr", "width")``) only
        those; with one dict (or `argparse.Namespace`), that. The Trainer stores them in
        every checkpoint (a module's under ``"hyper_parameters"``, a datamodule's under
        ``"datamodule_hyper_parameters"``) and gives them to its loggers at the start of
        ``fit``; ``load_from_checkpoint`` passes them back to ``__init__``. Only plain
        values (numbers, strings, lists, dicts, tensors) go into checkpoints, which load
        with ``weights_only=True``; others (a class, a module) stay out, with a warning, and
        are passed again to ``load_from_checkpoint``.

        Args:
            args: argument names to record, or one dict to record as it is.
            ignore: argument names to leave out (a module or a dataset passed in, say).
            frame: the frame of the ``__init__`` whose arguments to record (default: the
                caller's).
            logger: give them to the loggers when a fit starts.

        Raises:
            ConfigurationError: a name that is not an argument of the calling ``__init__``,
                or a call from outside a function.
        """
        self._log_hyperparams = bool(logger)
        current = inspect.currentframe()
        try:
            caller = frame if frame is not None else (current.f_back if current else None)
            record_hparams(self, hparams_from_caller(self, caller, args, ignore))
        finally:
            del current
        self.__dict__["_hparams_initial"] = copy.deepcopy(dict(self.hparams))

    def remove_ignored_hparams(self, ignore_list: Sequence[str]) -> None:
        """Drop these names from ``hparams`` (a subclass leaving out what its base saved)."""
        for key in ignore_list:
            self.hparams.pop(key, None)

    def hparams_for_checkpoint(self) -> dict[str, Any]:
        """The hyperparameters a checkpoint stores: those that load with
        ``weights_only=True`` (plain values), so reading the checkpoint runs no code."""
        return checkpoint_hparams(self.hparams)


def hparams_to_record(
    owner: object,
    frame: FrameType | None,
    args: Sequence[Any],
    ignore: str | Sequence[str] | None,
) -> dict[str, Any]:
    """What ``save_hyperparameters(*args, ignore=ignore)`` records: one dict (or
    `argparse.Namespace`) given in ``args``, or the arguments of the ``__init__`` that
    called it (whose own frame is ``frame``): all of them, or those named in ``args``;
    less ``ignore``.

    Raises:
        ConfigurationError: a name that is not an argument of the calling ``__init__``,
            or a call from outside a function.
    """
    try:
        caller = frame.f_back if frame is not None else None
        return hparams_from_caller(owner, caller, args, ignore)
    finally:
        del frame


def hparams_from_caller(
    owner: object,
    caller: FrameType | None,
    args: Sequence[Any],
    ignore: str | Sequence[str] | None,
) -> dict[str, Any]:
    """`hparams_to_record` given the frame of the calling ``__init__`` itself."""
    skip = {ignore} if isinstance(ignore, str) else set(ignore or ())
    if len(args) == 1 and isinstance(args[0], Namespace):
        args = [vars(args[0])]
    if len(args) == 1 and isinstance(args[0], Mapping):
        return {k: v for k, v in args[0].items() if k not in skip}
    if caller is None:
        raise ConfigurationError(
            "save_hyperparameters() could not see its caller; pass the values as a dict."
        )
    try:
        code = caller.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[1:count])  # the first is self
        if code.co_flags & inspect.CO_VARARGS:
            names.append(code.co_varnames[count])
            count += 1
        varkw = code.co_varnames[count] if code.co_flags & inspect.CO_VARKEYWORDS else None
        init_args: dict[str, Any] = {name: caller.f_locals.get(name) for name in names}
        if varkw is not None:
            init_args.update(caller.f_locals.get(varkw) or {})
    finally:
        del caller
    wanted = [str(a) for a in args] if args else list(init_args)
    unknown = [name for name in wanted if name not in init_args]
    if unknown:
        raise ConfigurationError(
            f"save_hyperparameters({', '.join(map(repr, unknown))}): not an argument of "
            f"{type(owner).__name__}.__init__ (its arguments: {sorted(init_args)})."
        )
    return {k: init_args[k] for k in wanted if k not in skip}


def record_hparams(owner: _HasHparams, values: dict[str, Any]) -> None:
    """Add ``values`` to ``owner.hparams``; warn (at the caller of
    ``save_hyperparameters``) about those a checkpoint cannot hold."""
    owner.hparams.update(values)
    unsafe = sorted(k for k, v in values.items() if not loads_safely(v))
    if unsafe:
        warnings.warn(
            f"save_hyperparameters(): {unsafe} of {type(owner).__name__} are not plain "
            "values (numbers, strings, lists, dicts, tensors), so checkpoints leave them "
            "out (loading a checkpoint runs no code). Pass them again to "
            "load_from_checkpoint(path, name=...), or leave them out with ignore=[...].",
            UserWarning,
            stacklevel=3,
        )


def checkpoint_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters a checkpoint stores: those that load with
    ``weights_only=True`` (plain values), so reading the checkpoint runs no code."""
    return {k: v for k, v in hparams.items() if loads_safely(v)}


def build_from_hparams(
    cls: type[T],
    checkpoint: Mapping[str, Any],
    key: str,
    checkpoint_path: str | Path,
    overrides: Mapping[str, Any],
) -> T:
    """``cls(**checkpoint[key], **overrides)``: an object built from the hyperparameters a
    checkpoint holds under ``key``, ``overrides`` replacing or adding arguments.

    Raises:
        CheckpointError: ``cls`` does not take those arguments.
    """
    hparams = dict(checkpoint.get(key) or {})
    try:
        return cls(**{**hparams, **overrides})
    except TypeError as err:
        raise CheckpointError(
            f"{cls.__name__} could not be built from {str(checkpoint_path)!r}'s "
            f"hyperparameters {sorted(hparams)} and the overrides {sorted(overrides)}: "
            f"{err}. Hyperparameters that are not plain values are not saved; pass them "
            "as keyword arguments to load_from_checkpoint."
        ) from err


def load_module(
    cls: type[ModuleT],
    checkpoint_path: str | Path,
    map_location: str | torch.device | None,
    strict: bool | None,
    weights_only: bool,
    overrides: dict[str, Any],
) -> ModuleT:
    """``Module.load_from_checkpoint``: build ``cls`` from the checkpoint's
    hyperparameters and ``overrides``, then load its weights.

    Raises:
        CheckpointError: nothing readable at the path, or weights that do not fit.
    """
    checkpoint = read_checkpoint(checkpoint_path, weights_only=weights_only)
    if "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{str(checkpoint_path)!r} is not an accord checkpoint (no 'state_dict')."
        )
    model = build_from_hparams(cls, checkpoint, "hyper_parameters", checkpoint_path, overrides)
    try:
        model.load_state_dict(
            module_names(model, checkpoint["state_dict"]),
            strict=model.strict_loading if strict is None else strict,
        )
    except RuntimeError as err:
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        raise CheckpointError(
            f"{str(checkpoint_path)!r} does not fit {cls.__name__}"
            f"({', '.join(f'{k}={v!r}' for k, v in {**hparams, **overrides}.items())}): "
            f"it was saved from a different model or configuration.\n{err}"
        ) from err
    if map_location is not None:
        model.to(map_location)
    model.on_load_checkpoint(checkpoint)
    return model


def run_hyperparameters(module: Module | None, datamodule: DataModule | None) -> dict[str, Any]:
    """The hyperparameters the loggers get when a fit starts: the module's and the
    datamodule's merged, as Lightning merges them (each only when its
    ``save_hyperparameters`` did not pass ``logger=False``; empty when neither saved any).

    Raises:
        ConfigurationError: a name both hold, with different values.
    """
    own = _loggable(module)
    data = _loggable(datamodule)
    clashes = sorted(k for k in own.keys() & data.keys() if not _same(own[k], data[k]))
    if clashes:
        raise ConfigurationError(
            f"The module and the datamodule both save the hyperparameters {clashes}, with "
            "different values, so the loggers cannot get one value of each. Rename one, or "
            "leave it out of one save_hyperparameters(ignore=[...])."
        )
    return {**own, **data}


def log_hyperparameters(
    loggers: Iterable[Logger], module: Module, datamodule: DataModule | None
) -> None:
    """What the loggers get when a fit starts, as in Lightning: `run_hyperparameters`
    (when there are any), the module's graph (``log_graph``), then a save."""
    params = run_hyperparameters(module, datamodule)
    for logger in loggers:
        if params:
            logger.log_hyperparams(params)
        logger.log_graph(module)
        logger.save()


def _loggable(owner: Module | DataModule | None) -> dict[str, Any]:
    if owner is None or not getattr(owner, "_log_hyperparams", True):
        return {}
    return dict(owner.hparams)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # a comparison that gives no single answer
        return a is b


def loads_safely(value: Any) -> bool:
    """Whether ``value`` comes back from ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # any failure means it is not a plain value
        return False
    return True
