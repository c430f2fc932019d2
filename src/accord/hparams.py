"""Hyperparameter handling behind `Module`: the `AttributeDict` that ``hparams`` is, the
reading of the calling ``__init__``'s arguments for ``save_hyperparameters``, the check
of which values a checkpoint can hold, and ``load_from_checkpoint``'s building of a
module from a checkpoint."""

from __future__ import annotations

import inspect
import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from accord.checkpoint_io import read_checkpoint
from accord.compiled import module_names
from accord.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module

__all__ = ["AttributeDict"]

ModuleT = TypeVar("ModuleT", bound="Module")


class AttributeDict(dict[str, Any]):
    """A dict whose keys read as attributes too: ``hparams.lr`` is ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"No hyperparameter {key!r}; saved: {sorted(self)}.") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def hparams_to_record(
    module: Module,
    frame: FrameType | None,
    args: Sequence[Any],
    ignore: str | Sequence[str] | None,
) -> dict[str, Any]:
    """What ``save_hyperparameters(*args, ignore=ignore)`` records: one dict given in
    ``args``, or the arguments of the ``__init__`` that called it (whose own frame is
    ``frame``): all of them, or those named in ``args``; less ``ignore``.

    Raises:
        ConfigurationError: a name that is not an argument of the calling ``__init__``,
            or a call from outside a function.
    """
    skip = {ignore} if isinstance(ignore, str) else set(ignore or ())
    if len(args) == 1 and isinstance(args[0], Mapping):
        return {k: v for k, v in args[0].items() if k not in skip}
    caller = frame.f_back if frame is not None else None
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
        del frame, caller
    wanted = [str(a) for a in args] if args else list(init_args)
    unknown = [name for name in wanted if name not in init_args]
    if unknown:
        raise ConfigurationError(
            f"save_hyperparameters({', '.join(map(repr, unknown))}): not an argument of "
            f"{type(module).__name__}.__init__ (its arguments: {sorted(init_args)})."
        )
    return {k: init_args[k] for k in wanted if k not in skip}


def record_hparams(module: Module, values: dict[str, Any]) -> None:
    """Add ``values`` to ``module.hparams``; warn (at the caller of
    ``save_hyperparameters``) about those a checkpoint cannot hold."""
    module.hparams.update(values)
    unsafe = sorted(k for k, v in values.items() if not loads_safely(v))
    if unsafe:
        warnings.warn(
            f"save_hyperparameters(): {unsafe} of {type(module).__name__} are not plain "
            "values (numbers, strings, lists, dicts, tensors), so checkpoints leave them "
            "out (loading a checkpoint runs no code). Pass them again to "
            "load_from_checkpoint(path, name=...), or leave them out with ignore=[...].",
            UserWarning,
            stacklevel=3,
        )


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
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    try:
        model = cls(**{**hparams, **overrides})
    except TypeError as err:
        raise CheckpointError(
            f"{cls.__name__} could not be built from {str(checkpoint_path)!r}'s "
            f"hyperparameters {sorted(hparams)} and the overrides {sorted(overrides)}: "
            f"{err}. Hyperparameters that are not plain values are not saved; pass them "
            "as keyword arguments to load_from_checkpoint."
        ) from err
    try:
        model.load_state_dict(
            module_names(model, checkpoint["state_dict"]),
            strict=model.strict_loading if strict is None else strict,
        )
    except RuntimeError as err:
        raise CheckpointError(
            f"{str(checkpoint_path)!r} does not fit {cls.__name__}"
            f"({', '.join(f'{k}={v!r}' for k, v in {**hparams, **overrides}.items())}): "
            f"it was saved from a different model or configuration.\n{err}"
        ) from err
    if map_location is not None:
        model.to(map_location)
    model.on_load_checkpoint(checkpoint)
    return model


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
