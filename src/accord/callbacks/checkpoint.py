"""`Checkpoint`: the base class the Trainer recognises as a checkpointing callback."""

from __future__ import annotations

from accord.callbacks.callback import Callback

__all__ = ["Checkpoint"]


class Checkpoint(Callback):
    """Base class of the callbacks that save checkpoints (`ModelCheckpoint`,
    `OnExceptionCheckpoint`), as in Lightning.

    The Trainer treats any subclass as a checkpointing callback: it runs after the other
    callbacks (so a checkpoint holds what they did at that point), its
    ``on_train_epoch_end`` runs after the module's, and with one among the callbacks
    ``enable_checkpointing`` adds no default `ModelCheckpoint`. Subclass it to write your
    own checkpointing callback.
    """
