"""The sanity check before training: ``num_sanity_val_steps`` validation batches run to
catch errors in the validation code early, leaving no trace in the run."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

from accord.trainer.evaluation_loop import evaluate

if TYPE_CHECKING:
    from accord.trainer.fit_loop import FitLoop

__all__ = ["sanity_check"]


def sanity_check(loop: FitLoop) -> None:
    """``num_sanity_val_steps`` validation batches before training, with their hooks;
    what they log is dropped, and the RNG is left as it was (Lightning's rule). A
    resumed fit skips it."""
    trainer, state = loop.trainer, loop.state
    hooks = state.hooks
    assert hooks is not None
    if (
        not trainer.has_validation
        or trainer.num_sanity_val_steps == 0
        or state.ckpt_path is not None
    ):
        return
    rng = (torch.get_rng_state(), random.getstate(), _numpy_state())
    previous, state.running = state.running, "sanity_check"
    hooks.call("on_sanity_check_start")
    loop.load_val()
    if loop.val_loader is not None and trainer.has_validation:
        evaluate(trainer, state, "sanity_check", loop.val_loader)
    metrics = state.metrics
    metrics.callback_metrics.clear()
    metrics.progress_bar_metrics.clear()
    hooks.call("on_sanity_check_end")
    state.running = previous
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    _set_numpy_state(rng[2])


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _set_numpy_state(value: Any) -> None:
    if value is None:
        return
    import numpy

    numpy.random.set_state(value)
