"""`LambdaCallback`: a callback made of functions, one per hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

__all__ = ["LambdaCallback"]


class LambdaCallback(Callback):
    """A callback whose hooks are the functions given, by hook name (Lightning's
    arguments, in Lightning's order).

    Each function is called where the hook of that name would be, with the hook's
    arguments: ``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)``. Hooks
    not given cost nothing. Every argument is named after a `Callback` hook (all of
    Lightning's but ``state_dict`` and ``load_state_dict``) and takes the function to run
    there, or None.

    Raises:
        ConfigurationError: an argument that is neither None nor callable.
    """

    def __init__(
        self,
        setup: Callable[..., Any] | None = None,
        teardown: Callable[..., Any] | None = None,
        on_fit_start: Callable[..., Any] | None = None,
        on_fit_end: Callable[..., Any] | None = None,
        on_sanity_check_start: Callable[..., Any] | None = None,
        on_sanity_check_end: Callable[..., Any] | None = None,
        on_train_batch_start: Callable[..., Any] | None = None,
        on_train_batch_end: Callable[..., Any] | None = None,
        on_train_epoch_start: Callable[..., Any] | None = None,
        on_train_epoch_end: Callable[..., Any] | None = None,
        on_validation_epoch_start: Callable[..., Any] | None = None,
        on_validation_epoch_end: Callable[..., Any] | None = None,
        on_test_epoch_start: Callable[..., Any] | None = None,
        on_test_epoch_end: Callable[..., Any] | None = None,
        on_validation_batch_start: Callable[..., Any] | None = None,
        on_validation_batch_end: Callable[..., Any] | None = None,
        on_test_batch_start: Callable[..., Any] | None = None,
        on_test_batch_end: Callable[..., Any] | None = None,
        on_train_start: Callable[..., Any] | None = None,
        on_train_end: Callable[..., Any] | None = None,
        on_validation_start: Callable[..., Any] | None = None,
        on_validation_end: Callable[..., Any] | None = None,
        on_test_start: Callable[..., Any] | None = None,
        on_test_end: Callable[..., Any] | None = None,
        on_exception: Callable[..., Any] | None = None,
        on_save_checkpoint: Callable[..., Any] | None = None,
        on_load_checkpoint: Callable[..., Any] | None = None,
        on_before_backward: Callable[..., Any] | None = None,
        on_after_backward: Callable[..., Any] | None = None,
        on_before_optimizer_step: Callable[..., Any] | None = None,
        on_before_zero_grad: Callable[..., Any] | None = None,
        on_predict_start: Callable[..., Any] | None = None,
        on_predict_end: Callable[..., Any] | None = None,
        on_predict_batch_start: Callable[..., Any] | None = None,
        on_predict_batch_end: Callable[..., Any] | None = None,
        on_predict_epoch_start: Callable[..., Any] | None = None,
        on_predict_epoch_end: Callable[..., Any] | None = None,
    ) -> None:
        for name, function in dict(locals()).items():
            if name == "self" or function is None:
                continue
            if not callable(function):
                raise ConfigurationError(
                    f"LambdaCallback({name}=...) must be a function, got {type(function).__name__}."
                )
            # An instance attribute: called as the hook, with (trainer, module, ...).
            setattr(self, name, function)
